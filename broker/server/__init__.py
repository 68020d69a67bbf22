"""Client-facing network code: connections and listeners."""
