"""The harness the tests and the benchmarks share: real broker processes on loopback
ports (`processes`), a cluster of sites with its controller (`cluster`), the network
between them with cuts (`netns`), and the one poll loop (`waiting`).

It is a package of its own so that `bench/` does not import `tests/`."""
