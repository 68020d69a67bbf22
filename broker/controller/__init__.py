"""The local cluster (docs/replication.md, "The controller"): the controller that owns placement
(`decisions`, pure; `controller`, the process), and `stratamq cluster`, which runs a
controller and several sites on one machine (`supervisor`)."""
