"""The names of a testbed's kernel resources live in testbed.names now (below every layer: the
state's schema checks them). This module keeps the old import path for the modules that still use
it; they move to testbed.names with issue #24, and this file goes."""

from testbed.names import (  # noqa: F401
    CUT_MARK,
    IFNAMSIZ,
    PREFIX,
    cut_netns,
    mac_for,
    netns,
    netns_prefix,
    valid_testbed_name,
)
