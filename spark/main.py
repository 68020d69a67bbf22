"""The Python file spark-submit runs as the application (`spark-submit ... main.py JOB
...`; the image has it at /opt/stratamq/spark-main.py): `stratamq spark` under
spark-submit's master."""

from __future__ import annotations

import sys

from stratamq.spark.cli import spark_main

if __name__ == "__main__":
    sys.exit(spark_main(sys.argv[1:]))
