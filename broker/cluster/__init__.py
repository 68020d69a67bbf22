"""The local cluster (docs/architecture.md, "Replication"): the controller that owns placement
(`decisions`, pure; `controller`, the process), and `stratamq cluster`, which runs a
controller and several sites on one machine (`supervisor`)."""
