#!/bin/bash
# The Spark image's entrypoint (what Apache Spark's image does with /opt/entrypoint.sh,
# for this image):
#   executor       a Spark executor, as the driver starts it on an executor pod: the
#                  driver sets SPARK_DRIVER_URL, SPARK_EXECUTOR_{ID,CORES,MEMORY,POD_IP,
#                  POD_NAME}, SPARK_APPLICATION_ID, SPARK_RESOURCE_PROFILE_ID and the
#                  JVM options as SPARK_JAVA_OPT_0, _1, ... in the pod's env
#   driver ARGS    a cluster-mode driver (the Spark operator's path): spark-submit in
#                  client mode in this pod, bound to SPARK_DRIVER_BIND_ADDRESS
#   anything else  run as given (the operator's Job: `stratamq spark submit ...`)
set -euo pipefail

: "${SPARK_HOME:=/opt/spark}"
# tini reaps the JVM's children and passes signals on (the image has it; a machine
# without it, as in tests/integration/test_images.py, runs the JVM directly).
init=()
if [ -x /usr/bin/tini ]; then init=(/usr/bin/tini -s --); fi
classpath="$SPARK_HOME/jars/*"
# Spark mounts the executor's configuration (and any Hadoop configuration) here.
classpath="${HADOOP_CONF_DIR:+$HADOOP_CONF_DIR:}${SPARK_CONF_DIR:-$SPARK_HOME/conf}:$classpath"
classpath="$classpath${SPARK_EXTRA_CLASSPATH:+:$SPARK_EXTRA_CLASSPATH}:$PWD"

case "${1:-}" in
  executor)
    # The JVM options in their order (SPARK_JAVA_OPT_<n>, n from 0).
    java_options=()
    while IFS= read -r name; do
      java_options+=("${!name}")
    done < <(compgen -e | sed -n 's/^SPARK_JAVA_OPT_\([0-9][0-9]*\)$/\1 &/p' \
               | sort -n | cut -d' ' -f2)
    exec "${init[@]}" "$JAVA_HOME/bin/java" "${java_options[@]}" \
      "-Xms$SPARK_EXECUTOR_MEMORY" "-Xmx$SPARK_EXECUTOR_MEMORY" -cp "$classpath" \
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
      --driver-url "$SPARK_DRIVER_URL" --executor-id "$SPARK_EXECUTOR_ID" \
      --cores "$SPARK_EXECUTOR_CORES" --app-id "$SPARK_APPLICATION_ID" \
      --hostname "$SPARK_EXECUTOR_POD_IP" \
      --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID:-0}" \
      --podName "$SPARK_EXECUTOR_POD_NAME"
    ;;
  driver)
    shift
    exec "${init[@]}" "$SPARK_HOME/bin/spark-submit" \
      --conf "spark.driver.bindAddress=$SPARK_DRIVER_BIND_ADDRESS" \
      --conf "spark.executorEnv.SPARK_DRIVER_POD_IP=$SPARK_DRIVER_BIND_ADDRESS" \
      --deploy-mode client "$@"
    ;;
  *)
    exec "$@"
    ;;
esac
