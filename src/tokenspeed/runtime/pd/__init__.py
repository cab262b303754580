"""Prefill/decode disaggregation, engine side: a request prefilled on one engine is decoded on
another, its cache (the prompt's MLA rows and its live KDA state at the prompt's end) moved
between them by a transport (Mooncake's transfer engine, or plain sockets). See
docs/design.md, "P/D handoff".

    p = PrefillEngine(model, config=...)     d = DecodeEngine(model, config=...)
    p.add_request(rid, prompt, params)       destination = d.admit(rid, prompt, params)
    ...p.step() until rid in p.held()...
    p.send(rid, destination).result(30)      ...d.step(): rid decodes from its first token...
"""

from .decode import DecodeEngine
from .messages import Destination, FirstToken, Handoff, HandoffError
from .prefill import PrefillEngine
from .transport import MooncakeTransport, SocketTransport, Transport, make_transport

__all__ = [
    "DecodeEngine",
    "Destination",
    "FirstToken",
    "Handoff",
    "HandoffError",
    "MooncakeTransport",
    "PrefillEngine",
    "SocketTransport",
    "Transport",
    "make_transport",
]
