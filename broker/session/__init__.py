"""MQTT sessions: what a client has subscribed to and what is on its way to it."""
