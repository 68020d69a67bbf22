"""One MQTT connection's protocol: the per-connection state (channel.py) and one
handler module per inbound packet type (after Mosquitto's handle_*.c)."""
