"""The data plane on one machine: namespaces, links, routes and shaping via netlink."""
