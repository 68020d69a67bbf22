"""The network side of client connections: listeners (TCP, TLS, WebSocket),
transports with write buffering, and the read loop that turns bytes into packets.
Knows bytes and packets, nothing of sessions."""
