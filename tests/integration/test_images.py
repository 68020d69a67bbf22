"""The Dockerfiles in images/ (Docker cannot run on these machines, so what can be
checked without it is): every file they copy from the repository exists and is not
ignored, base images are pinned, the images run as a non-root user, every package of
pyproject.toml is copied for the build, and their default commands start — the
broker's with the configuration file the image ships, answering /readyz."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.processes import HOST, REPO, free_port

IMAGES = REPO / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
STRATAMQ = Path(sys.executable).with_name("stratamq")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]]


def parse(dockerfile: Path) -> list[Stage]:
    """The stages of a Dockerfile, `ARG` defaults substituted into `FROM`."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "ARG" and "=" in rest and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda match: args[match.group(1)], rest).split()
            stages.append(Stage(words[0], words[2] if len(words) > 2 else None, []))
        elif stages:
            stages[-1].instructions.append((keyword, rest))
    return stages


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    found = []
    for keyword, rest in stage.instructions:
        if keyword == "COPY" and "--from=" not in rest:
            words = [word for word in shlex.split(rest) if not word.startswith("--")]
            found.append((words[:-1], words[-1]))
    return found


def ignored(path: str) -> bool:
    patterns = [line.strip().rstrip("/") for line in
                (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    parts = Path(path).parts
    return any(fnmatch.fnmatch(path, pattern) or pattern in parts for pattern in patterns)


def exec_form(stage: Stage, keyword: str) -> list[str]:
    values = [rest for word, rest in stage.instructions if word == keyword]
    assert values, f"no {keyword}"
    parsed = json.loads(values[-1])  # the exec form is a JSON list of strings
    assert isinstance(parsed, list) and all(isinstance(word, str) for word in parsed)
    return parsed


def test_there_are_two_images() -> None:
    assert [path.parent.name for path in DOCKERFILES] == ["spark", "stratamq"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.parent.name)
def test_dockerfile_builds_from_what_the_repository_has(dockerfile: Path) -> None:
    stages = parse(dockerfile)
    names = {stage.name for stage in stages}
    for stage in stages:
        if stage.base in names:
            continue
        image, _, tag = stage.base.rpartition(":")
        assert image and re.fullmatch(r"[\w.-]*\d+\.\d+[\w.-]*", tag) and tag != "latest", (
            f"{dockerfile}: base image {stage.base!r} is not pinned to a version")
    copied: set[str] = set()
    for stage in stages:
        for sources, _ in copies(stage):
            for source in sources:
                assert (REPO / source).exists(), f"{dockerfile}: COPY {source}: not in the repo"
                assert not ignored(source), f"{dockerfile}: COPY {source}: .dockerignore'd"
                copied.add(source)
    # a non-editable install needs every package folder of pyproject.toml
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert {"pyproject.toml", "README.md"} <= copied
    assert package_dirs <= copied, f"{dockerfile}: not copied: {package_dirs - copied}"
    user = [rest for keyword, rest in stages[-1].instructions if keyword == "USER"]
    assert user and user[-1].split(":")[0].isdigit() and int(user[-1].split(":")[0]) > 0, (
        f"{dockerfile}: the final stage must run as a numeric non-root user")


def in_repository(stage: Stage, image_path: str) -> Path:
    """The repository file that the image has at `image_path` (by its COPY lines)."""
    for sources, destination in copies(stage):
        if destination == image_path and len(sources) == 1:
            return REPO / sources[0]
    raise AssertionError(f"the image copies nothing to {image_path}")


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, ConnectionError):
        return False


def test_broker_image_default_command_starts_a_site(tmp_path: Path) -> None:
    final = parse(IMAGES / "stratamq" / "Dockerfile")[-1]
    command = exec_form(final, "ENTRYPOINT") + exec_form(final, "CMD")
    assert command[:2] == ["stratamq", "broker"] and command[2] == "--config"
    config = in_repository(final, command[3])
    # the ports are the image's own; here they must not clash with anything
    admin = free_port()
    environment = {**os.environ,
                   "STRATAMQ__LISTENERS__TCP__BIND": f"{HOST}:{free_port()}",
                   "STRATAMQ__LISTENERS__WS__BIND": f"{HOST}:{free_port()}",
                   "STRATAMQ__ADMIN__BIND": f"{HOST}:{admin}"}
    with (tmp_path / "site.log").open("wb") as log:
        site = subprocess.Popen([str(STRATAMQ), *command[1:3], str(config)], cwd=tmp_path,
                                env=environment, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not ready(admin) and site.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert ready(admin), (tmp_path / "site.log").read_text()[-3000:]
            assert (tmp_path / "data").is_dir()  # data_dir lands in the WORKDIR (the volume)
        finally:
            site.send_signal(signal.SIGTERM)
            assert site.wait(30) == 0, (tmp_path / "site.log").read_text()[-3000:]


def test_spark_image_default_command_runs() -> None:
    final = parse(IMAGES / "spark" / "Dockerfile")[-1]
    command = exec_form(final, "CMD")
    assert command[0] == "stratamq"
    result = subprocess.run([str(STRATAMQ), *command[1:]], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_spark_image_entrypoint_starts_an_executor(tmp_path: Path) -> None:
    """images/spark/entrypoint.sh `executor`, with the env Spark's driver gives an
    executor pod, on the pyspark wheel's Spark (as the image's SPARK_HOME): the JVM
    starts Spark's Kubernetes executor with its arguments and options, and it reaches
    for the driver (none listens here: it fails on the connection, not before)."""
    final = parse(IMAGES / "spark" / "Dockerfile")[-1]
    [entrypoint] = exec_form(final, "ENTRYPOINT")
    script = in_repository(final, entrypoint)
    import pyspark

    port = free_port()
    java = Path(subprocess.run(["readlink", "-f", shutil.which("java") or "java"],
                               capture_output=True, text=True, check=True).stdout.strip())
    environment = {
        "PATH": os.environ["PATH"], "SPARK_HOME": str(Path(pyspark.__file__).parent),
        "JAVA_HOME": str(java.parent.parent), "SPARK_CONF_DIR": str(tmp_path),
        "SPARK_DRIVER_URL": f"spark://CoarseGrainedScheduler@{HOST}:{port}",
        "SPARK_EXECUTOR_ID": "1", "SPARK_EXECUTOR_CORES": "1",
        "SPARK_EXECUTOR_MEMORY": "256m", "SPARK_APPLICATION_ID": "spark-test",
        "SPARK_EXECUTOR_POD_IP": HOST, "SPARK_EXECUTOR_POD_NAME": "mq-spark-gc-exec-1",
        "SPARK_RESOURCE_PROFILE_ID": "0",
        # out of order on purpose: the JVM gets them by their number
        "SPARK_JAVA_OPT_1": f"-Dspark.driver.port={port}",
        "SPARK_JAVA_OPT_0": "-Dspark.stratamq.test=entrypoint"}
    result = subprocess.run(["bash", str(script), "executor"], capture_output=True,
                            text=True, timeout=120, env=environment, cwd=tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    assert "Usage" not in log and "ClassNotFoundException" not in log, log[-3000:]
    assert "KubernetesExecutorBackend: Started daemon" in log, log[-3000:]
    assert f"Failed to connect to /{HOST}:{port}" in log, log[-3000:]
    # anything else runs as given: the image's default command
    command = exec_form(final, "CMD")
    result = subprocess.run(["bash", str(script), str(STRATAMQ), *command[1:]],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_spark_image_entrypoint_runs_a_driver(tmp_path: Path) -> None:
    """`driver ARGS` (a driver pod of the Spark operator's cluster mode): spark-submit
    in client mode, bound where the pod's env says, runs the application."""
    final = parse(IMAGES / "spark" / "Dockerfile")[-1]
    script = in_repository(final, exec_form(final, "ENTRYPOINT")[0])
    import pyspark

    application = tmp_path / "application.py"
    application.write_text("from pyspark.sql import SparkSession\n"
                           "spark = SparkSession.builder.getOrCreate()\n"
                           "print('driver at', spark.conf.get('spark.driver.bindAddress'),"
                           " spark.range(4).count())\n")
    result = subprocess.run(
        ["bash", str(script), "driver", "--master", "local[1]", "--conf",
         "spark.ui.enabled=false", str(application)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "SPARK_HOME": str(Path(pyspark.__file__).parent),
             "SPARK_DRIVER_BIND_ADDRESS": HOST, "PYSPARK_PYTHON": sys.executable,
             "PYSPARK_DRIVER_PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"driver at {HOST} 4" in result.stdout, result.stdout[-3000:]


def test_the_operator_runs_from_the_broker_image() -> None:
    """The chart's operator Deployment runs `kopf run -m MODULE` in the broker image:
    the image installs the operator extra, so kopf and the module must be there."""
    final = parse(IMAGES / "stratamq" / "Dockerfile")
    assert any("[operator]" in rest for stage in final for keyword, rest in stage.instructions
               if keyword == "RUN")
    deployment = (REPO / "charts" / "stratamq" / "templates" / "operator-deployment.yaml")
    command = re.search(r"command:\s*\n\s*- kopf\s*\n\s*- run\s*\n\s*- -m\s*\n\s*- ([\w.]+)",
                        deployment.read_text())
    assert command, "the operator Deployment does not run `kopf run -m MODULE`"
    kopf = Path(sys.executable).with_name("kopf")
    result = subprocess.run([str(kopf), "run", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    result = subprocess.run([sys.executable, "-c", f"import {command.group(1)}"],
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
