"""The wheelhouse, received on a host and checked before anything is unpacked (install.sh's `receive`).

Run as ``PYTHON -I -c TEXT DEST SHA256 BYTES`` with the wheelhouse tar on stdin. Writes it to DEST
(made new: never an existing file, never through a link), hashing it as it comes, and exits with
status 4 (install.RECEIVE_REFUSED), saying both digests on stderr, unless exactly BYTES bytes with
that sha256 came: install.sh then stops and unpacks nothing. The digest and size are the ones the
controller recorded when it built the wheelhouse, so a wheels.tar changed since is refused here.
"""

import hashlib
import os
import sys

REFUSED = 4
CHUNK = 1 << 20


def receive(src, dest, want, size):
    """Copy `src` (a binary file) to the new file `dest`, reading at most size + 1 bytes (one more
    than promised is enough to refuse it); (bytes read, their sha256)."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    h, n = hashlib.sha256(), 0
    with os.fdopen(fd, "wb") as out:
        while n <= size:
            chunk = src.read(min(CHUNK, size + 1 - n))
            if not chunk:
                break
            h.update(chunk)
            n += len(chunk)
            out.write(chunk)
    return n, h.hexdigest()


def main(argv):
    dest, want, size = argv[0], argv[1], int(argv[2])
    n, got = receive(sys.stdin.buffer, dest, want, size)
    if n != size or got != want:
        sys.stderr.write("the wheelhouse received is not the one the controller built and recorded: "
                         "%s%d bytes with sha256 %s, expected %d bytes with sha256 %s; nothing unpacked\n"
                         % ("over " if n > size else "", n, got, size, want))
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
