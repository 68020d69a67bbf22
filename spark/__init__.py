"""The data pipeline on Spark (PySpark): a data source over storage checkpoints
(`spark.read.format("stratamq")`) and the maintenance jobs run by `stratamq spark`.
See spark/README.md."""
