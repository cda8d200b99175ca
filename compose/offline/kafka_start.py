"""Start a KRaft Kafka node configured the way the apache/kafka image is (compose/offline/Dockerfile).

Every ``KAFKA_*`` variable but the JVM's (``KAFKA_HEAP_OPTS``, ``KAFKA_OPTS``) is a server property:
the prefix dropped, lower case, ``_`` read as ``.``, ``__`` as ``_`` and ``___`` as ``-``
(``KAFKA_NODE_ID`` is ``node.id``). The storage is formatted with ``CLUSTER_ID`` (the image's
default id when unset) unless it already is, then the broker replaces this process.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

HOME = "/opt/kafka"
CONFIG = f"{HOME}/config/server.properties"
DEFAULT_CLUSTER_ID = "5L6g3nShT-eMCtK--X86sw"
"""apache/kafka's default CLUSTER_ID."""
JVM_VARIABLES = frozenset({"KAFKA_HEAP_OPTS", "KAFKA_OPTS", "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_LOG4J_OPTS"})
DEFAULTS = {"log.dirs": "/var/lib/kafka/data"}
"""What the environment may leave out (the folder of the image's data volume)."""


def property_name(variable: str) -> str:
    """``KAFKA_LISTENER_SECURITY_PROTOCOL_MAP`` -> ``listener.security.protocol.map``."""
    parts = re.split(r"(_{1,3})", variable.removeprefix("KAFKA_").lower())
    return "".join({"_": ".", "__": "_", "___": "-"}.get(part, part) for part in parts)


def server_properties(environ: dict[str, str]) -> dict[str, str]:
    """The broker's properties that ``environ`` gives (over :data:`DEFAULTS`)."""
    props = dict(DEFAULTS)
    for name, value in environ.items():
        if name.startswith("KAFKA_") and name not in JVM_VARIABLES:
            props[property_name(name)] = value
    return props


def java(main: str, *args: str, heap: str) -> list[str]:
    """The java command line of ``main`` on Kafka's jars."""
    return ["java", *shlex.split(heap), *shlex.split(os.environ.get("KAFKA_OPTS", "")),
            f"-Dlog4j2.configurationFile={HOME}/config/log4j2.properties", "-Djava.awt.headless=true",
            "-cp", f"{HOME}/libs/*", main, *args]


def main() -> None:
    """Write the properties, format the storage once, exec the broker."""
    props = server_properties(dict(os.environ))
    with open(CONFIG, "w", encoding="utf-8") as out:
        out.writelines(f"{k}={v}\n" for k, v in sorted(props.items()))
    cluster_id = os.environ.get("CLUSTER_ID", DEFAULT_CLUSTER_ID)
    subprocess.run(java("kafka.tools.StorageTool", "format", "--ignore-formatted", "-t", cluster_id, "-c", CONFIG,
                        heap="-Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"), check=True)
    command = java("kafka.Kafka", CONFIG, heap=os.environ.get("KAFKA_HEAP_OPTS", "-Xmx512m -Xms512m"))
    sys.stdout.flush()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
