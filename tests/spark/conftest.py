"""One local SparkSession per test module: starting one takes seconds of a 2-core
machine, and a module's tests share their checkpoint anyway."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from stratamq.spark.session import spark_session


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    session = spark_session("stratamq-tests", master="local[2]", shuffle_partitions=2,
                            config={"spark.ui.enabled": "false",
                                    "spark.sql.execution.arrow.pyspark.enabled": "true"})
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
