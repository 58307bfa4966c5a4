"""`shardkit.inspect` is `shardkit.hlo` under its old name, kept so existing code and tests keep working.

`shardkit.inspect.summarize`, `collective_summary`, `hlo_summary`, `memory_stats` and every other name of
`shardkit.hlo` are reachable here: importing this module hands back `shardkit.hlo` itself, so the two names are one
module (a monkeypatch through either reaches both). New code should import `shardkit.hlo`; the module was renamed
because `inspect` shadows the standard library's module and did not match the `shardkit hlo` command.
"""

import sys

from shardkit import hlo

sys.modules[__name__] = hlo
