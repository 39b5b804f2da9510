"""Outbound-only hosts: what a host behind NAT (or a firewall that only lets connections out)
looks like on the emulated cluster. An nftables table in the host's namespace drops every new
inbound TCP connection on its link (a SYN that is not an answer to one the host sent); replies
to what the host dialed pass, and so does traffic inside the host (the loopback, its own
address). Needs ``nft`` (Debian's nftables; ``make test`` installs it): without it, or where the
rules cannot be loaded, :func:`block_inbound` raises :class:`ClusterUnavailable`, so a test
that needs the rules fails, never skips.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

#: The table each outbound-only host loads.
RULES = """table inet gradstar_outbound {
    chain input {
        type filter hook input priority 0; policy accept;
        iifname "eth0" tcp flags syn / syn,ack,rst ct state new drop
    }
}
"""


def block_inbound(argv: Callable[[Sequence[str]], list[str]], host: str,
                  unavailable: type[Exception]) -> None:
    """Load :data:`RULES` in ``host`` (``argv(command)`` wraps a command to run there).

    Raises:
        unavailable: no ``nft``, or the rules could not be loaded (the reason named).
    """
    if shutil.which("nft") is None:
        raise unavailable("outbound-only hosts need nftables' nft (apt-get install nftables; "
                          "make test installs it)")
    try:
        subprocess.run(argv(["nft", "-f", "-"]), input=RULES, text=True, check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip()
        raise unavailable(f"cannot load the outbound-only rules on {host}: {detail[:300]}") \
            from None
