"""What a peer of the daemon's sockets is and has begun, apart from its connection's I/O
(`connection.PeerConnection`): the server's role classes keep these, the connection only
carries them."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.core.identity import ClientIdentity


@dataclass(slots=True)
class Session:
    ident: ClientIdentity | None = None  # the kernel's word, read once the peer is admitted
    client_id: int | None = None  # once registered as a hook
    asked: dict[int, int] = field(default_factory=dict)  # seq -> type of a pending request
