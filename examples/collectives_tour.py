"""Every collective a data-parallel job issues, once each, with a check of what came back.

Run on its own (`testbed run -- python examples/collectives_tour.py`) every rank is
real; with `testbed run --real w0 -- ...` rank 0 is real and the others are phantoms,
which mirror each call (the checks then run on rank 0 only: a phantom's data is not
the job's). Exits 0 when every call returned what it should.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True

    def check(what: str, good: bool) -> None:
        nonlocal ok
        if rank == 0 and not good:
            print(f"FAILED: {what}", flush=True)
            ok = False

    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)              # MAX: a phantom must not SUM
    check("all_reduce MAX", t.shape == (1000,))
    big = torch.ones(300_000)                               # above the announcement's data limit
    dist.all_reduce(big)
    b = torch.zeros(4096)
    dist.broadcast(b, src=world - 1)                        # from a phantom when there are phantoms
    outs = [torch.empty(512) for _ in range(world)]
    dist.all_gather(outs, torch.full((512,), float(rank)))
    check("all_gather", outs[0][0].item() == 0.0)
    flat = torch.empty(world * 2048)                        # FSDP's parameter gather
    dist.all_gather_into_tensor(flat, torch.full((2048,), float(rank)))
    check("all_gather_into_tensor", flat[0].item() == 0.0)
    shard = torch.empty(4096)                                # FSDP's gradient reduce-scatter
    dist.reduce_scatter_tensor(shard, torch.ones(world * 4096))
    rs = torch.empty(256)
    dist.reduce_scatter(rs, [torch.ones(256) for _ in range(world)])
    dist.reduce(torch.ones(128), dst=0)
    gl = [torch.empty(64) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((64,), float(rank)), gl, dst=0)
    check("gather", gl is None or gl[0][0].item() == 0.0)
    a2a = torch.empty(world * 32)
    dist.all_to_all_single(a2a, torch.arange(world * 32, dtype=torch.float32))
    dist.barrier()
    # functional collectives (DTensor, FSDP2, tensor parallelism): the group found by its name. Each
    # result is read (an AsyncCollectiveTensor waits there) and held to what it is with phantoms too
    # (their data is the real rank's or zeros): rank 0's own part, or a reduction's bounds
    pg = dist.group.WORLD
    g = funcol.all_gather_tensor(torch.full((8,), float(rank)), 0, pg)
    check("funcol all_gather_tensor", g.shape == (world * 8,) and g[:8].eq(float(rank)).all().item())
    r = funcol.reduce_scatter_tensor(torch.ones(world * 8), "sum", 0, pg)
    check("funcol reduce_scatter_tensor", r.shape == (8,) and 1.0 <= r.min().item() <= r.max().item() <= world)
    m = funcol.all_reduce(torch.full((16,), float(rank + 1)), "max", pg)
    check("funcol all_reduce", 1.0 <= m.min().item() <= m.max().item() <= world)
    x = funcol.all_to_all_single(torch.full((world * 4,), float(rank)), None, None, pg)
    check("funcol all_to_all_single", x.shape == (world * 4,) and x[:4].eq(float(rank)).all().item())
    y = funcol.broadcast(torch.full((32,), float(rank)), world - 1, pg)
    check("funcol broadcast", y.eq(y[0]).all().item() and y[0].item() in (0.0, float(world - 1)))
    a, c = funcol.all_gather_into_tensor_coalesced([torch.full((4,), float(rank)), torch.ones(6)], pg)
    check("funcol all_gather_into_tensor_coalesced", a.shape == (world * 4,) and a[:4].eq(float(rank)).all().item()
          and c.shape == (world * 6,) and c[:6].eq(1.0).all().item())
    d, e = funcol.reduce_scatter_tensor_coalesced([torch.ones(world * 4), torch.ones(world * 2)], "sum", [0, 0], pg)
    check("funcol reduce_scatter_tensor_coalesced", d.shape == (4,) and e.shape == (2,)
          and 1.0 <= min(d.min().item(), e.min().item()) <= max(d.max().item(), e.max().item()) <= world)
    low = dist.new_group([0, 1])                            # with the real rank
    high = dist.new_group([r for r in range(1, world)])     # without it: phantoms among themselves
    if rank in (0, 1):
        x = torch.ones(100)
        dist.all_reduce(x, group=low)
        check("new_group all_reduce", x.shape == (100,))
    flags = torch.tensor([1.0, 2.0])
    dist.all_reduce_coalesced([flags, torch.ones(3)])
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "argv": sys.argv[1:]})
    check("all_gather_object", isinstance(objs[0], dict))
    del high
    dist.destroy_process_group()
    if rank == 0:
        print("tour: " + ("ok" if ok else "FAILED"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
