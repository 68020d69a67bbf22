"""The SparkSession the jobs run in, with the `stratamq` data source registered.

Locally (`local[*]`) Python workers run this interpreter, so they import the same
installed `stratamq`; under `spark-submit --master k8s://...` the master, the image
and its Python come from spark-submit's own configuration and are left alone. Java
comes from the machine (JAVA_HOME or `java` on the PATH)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from .source import StratamqDataSource


def spark_session(app_name: str, master: str | None = None,
                  shuffle_partitions: int | None = None,
                  config: dict[str, str] | None = None) -> SparkSession:
    """A session for one job. `master` None keeps what spark-submit set."""
    # UTC: hours in the usage export are UTC hours wherever the job runs
    builder = SparkSession.builder.appName(app_name) \
        .config("spark.sql.session.timeZone", "UTC") \
        .config("spark.ui.showConsoleProgress", "false")  # a bar per stage, even at ERROR
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        # The JVM starts here: its logging is this package's (errors only), and it
        # binds loopback, as a local job needs, instead of warning that the host name
        # resolves to it.
        logging_file = Path(__file__).with_name("log4j2.properties")
        builder = builder.config("spark.driver.extraJavaOptions",
                                 f"-Dlog4j2.configurationFile=file:{logging_file}")
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # The workers that plan a Python data source's read follow the environment,
        # not `spark.pyspark.python`; both are set so every worker is this Python.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = builder.config("spark.pyspark.python", sys.executable)
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    # The jobs say what they did in a line of their own; Spark's warnings (a loopback
    # host name, no native Hadoop library) are noise to whoever runs them.
    session.sparkContext.setLogLevel("ERROR")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    session.dataSource.register(StratamqDataSource)
    return session
