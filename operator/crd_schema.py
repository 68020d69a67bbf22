"""The DurableStorage CRD's spec sections that mirror the broker's config, generated
from its model (broker/config.py): each field's type, description, default and limits,
keys in camelCase. Everything else in the CRD is written by hand, and so are the
sections' own lines; `generate` rewrites only the blocks between the markers

    # generated from the broker config model (make crds): <config section>
    ...
    # end of generated: <config section>

`make crds` (`python -m stratamq.operator.crd_schema`, from the repository root)
rewrites crds/durablestorages.stratamq.io.yaml and its copy in the chart;
tests/unit/test_crd_schema.py fails while the file is not what `generate` gives.

Values are as a config file writes them: durations and byte sizes are strings with a
unit (`10s`, `16MiB`), refused by the API server unless the broker would parse them
(CEL rules; their `maxLength` bounds the rules' cost in the API server's estimate)."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from stratamq.broker.config import Config, parse_byte_size, parse_duration

CRD_FILE = Path("crds/durablestorages.stratamq.io.yaml")
CHART_COPY = Path("charts/stratamq/crds/durablestorages.stratamq.io.yaml")

# Config section -> its keys the spec leaves out. The operator sets the data folder
# (each site's volume), the peer port and the address a site advertises (the pod's);
# a site's zone is its node's, which the operator reads itself.
SECTIONS: dict[str, frozenset[str]] = {
    "durable_storage.messages": frozenset({"data_dir"}),
    "durable_sessions": frozenset(),
    "mqtt": frozenset(),
    "cluster": frozenset({"enable", "peer_bind", "advertise", "zone"}),
}

# What the CRD says of a key beyond the broker's model (Kubernetes only).
CRD_ONLY: dict[str, dict[str, Any]] = {
    # A site keeps the shards it was made with; the API server refuses the change
    # before any site sees it. 1024: a bound on the placement the operator keeps.
    "durable_storage.messages.n_shards": {
        "maximum": 1024,
        "x-kubernetes-validations": [{
            "rule": "self == oldSelf",
            "message": "nShards is fixed when the storage is created and cannot be changed"}]},
    # Bounds for the API server's CEL cost estimate (and a sane spec).
    "durable_storage.messages.layout.wildcard_thresholds": {"maxItems": 16},
    "durable_sessions.retention_rules": {"maxProperties": 256},
}
# Byte sizes the spec takes as a whole number of bytes (an integer), not a string.
WHOLE_BYTES = frozenset({"durable_storage.messages.max_payload_bytes"})

DURATION_PATTERN = "^(([0-9]+([.][0-9]+)?|[.][0-9]+) *(ms|s|m|h|d) *)+$"
BYTE_SIZE_PATTERN = "^[1-9][0-9]* *([bB]|[kKmMgG]([iI]?[bB])?)?$"
POSITIVE_DURATION_RULE = {
    "rule": f"self.matches('{DURATION_PATTERN}') && self.matches('[1-9]')",
    "message": "must be a duration above 0 with a unit ms, s, m, h or d, such as 100ms, "
               "5s, 10m, 2h or 1d"}
DURATION_RULE = {  # zero allowed: "do not wait"
    "rule": f"self.matches('{DURATION_PATTERN}')",
    "message": "must be a duration with a unit ms, s, m, h or d, such as 0s, 5s or 10s"}
BYTE_SIZE_RULE = {
    "rule": f"self.matches('{BYTE_SIZE_PATTERN}')",
    "message": "must be a byte size above 0, such as 512KiB, 16MiB or 1GiB (units B, "
               "KB/KiB, MB/MiB, GB/GiB, 1024-based)"}
VALUE_MAX_LENGTH = 32

# The order of a schema's keys in the file, as the hand-written parts have them.
KEY_ORDER = ("type", "description", "default", "enum", "minimum", "maximum", "minLength",
             "maxLength", "minItems", "maxItems", "maxProperties", "items",
             "additionalProperties", "properties", "x-kubernetes-validations")

BEGIN = re.compile(r"^(?P<indent> *)# generated from the broker config model \(make crds\): "
                   r"(?P<section>[a-z_.]+)$")
END = "# end of generated: {section}"


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def format_duration(seconds: float) -> str:
    """A duration as a config file writes it, in its largest whole unit (`10m`, `1d`)."""
    milliseconds = round(seconds * 1000)
    if abs(milliseconds / 1000 - seconds) > 1e-9:
        raise ValueError(f"{seconds} s is not a whole number of milliseconds")
    if milliseconds == 0:
        return "0ms"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if milliseconds % size == 0:
            return f"{milliseconds // size}{unit}"
    return f"{milliseconds}ms"


def format_byte_size(size: int) -> str:
    """A byte size as a config file writes it, in its largest whole unit (`16MiB`)."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


def _flat_metadata(items: Sequence[Any]) -> Iterator[Any]:
    """Constraints and validators, those of a nested Field(...) included."""
    for item in items:
        if isinstance(item, FieldInfo):
            yield from item.metadata
        else:
            yield item


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """The type of an annotation, and its metadata. `X | None` is X: a key the spec
    may leave out (it has no default then)."""
    metadata: list[Any] = []
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation, *extra = get_args(annotation)
            metadata.extend(_flat_metadata(extra))
        elif origin in (Union, types.UnionType) and type(None) in get_args(annotation):
            (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
        else:
            return annotation, metadata


def _parser(metadata: Sequence[Any]) -> Callable[..., Any] | None:
    for item in metadata:
        if isinstance(item, BeforeValidator) and item.func in (parse_duration,
                                                               parse_byte_size):
            return item.func
    return None


def _limits(metadata: Sequence[Any], length: tuple[str, str]) -> dict[str, Any]:
    """Limits of the pydantic constraints; `length` names the ones of MinLen/MaxLen."""
    found: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            found["minimum"] = item.ge
        elif isinstance(item, annotated_types.Le):
            found["maximum"] = item.le
        elif isinstance(item, annotated_types.MinLen):
            found[length[0]] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            found[length[1]] = item.max_length
        elif not isinstance(item, BeforeValidator | AfterValidator):
            # A new kind of constraint: say how the CRD writes it before generating.
            raise TypeError(f"no CRD form for the constraint {item!r}")
    return found


def value_schema(dotted: str, annotation: Any, metadata: Sequence[Any]) -> dict[str, Any]:
    """The schema of the value at `dotted` in the config (without description or
    default)."""
    annotation, inner = _unwrap(annotation)
    metadata = [*_flat_metadata(metadata), *inner]
    parser = _parser(metadata)
    if parser is parse_duration:
        zero_allowed = not any(isinstance(item, annotated_types.Gt) for item in metadata)
        return {"type": "string", "maxLength": VALUE_MAX_LENGTH, "x-kubernetes-validations": [
            dict(DURATION_RULE if zero_allowed else POSITIVE_DURATION_RULE)]}
    if parser is parse_byte_size and dotted not in WHOLE_BYTES:
        return {"type": "string", "maxLength": VALUE_MAX_LENGTH,
                "x-kubernetes-validations": [dict(BYTE_SIZE_RULE)]}
    if annotation is bool:
        return {"type": "boolean"}
    if annotation is int:
        return {"type": "integer", **_limits(metadata, ("minimum", "maximum"))}
    if annotation is str:
        return {"type": "string", **_limits(metadata, ("minLength", "maxLength"))}
    if get_origin(annotation) is Literal:
        return {"type": "string", "enum": list(get_args(annotation))}
    if get_origin(annotation) is tuple:
        item, _ellipsis = get_args(annotation)
        return {"type": "array", **_limits(metadata, ("minItems", "maxItems")),
                "items": value_schema(dotted, item, [])}
    if get_origin(annotation) is dict:
        _key, value = get_args(annotation)
        return {"type": "object", "additionalProperties": value_schema(dotted, value, [])}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {"type": "object",
                "properties": section_properties(annotation, dotted, frozenset())}
    raise TypeError(f"no CRD form for the type {annotation!r}")


def spec_value(dotted: str, value: Any, parser: Callable[..., Any] | None) -> Any:
    """A default as the spec writes it (a section's: {}, the API server fills it in)."""
    if isinstance(value, BaseModel):
        return {}
    if parser is parse_duration:
        return format_duration(value)
    if parser is parse_byte_size and dotted not in WHOLE_BYTES:
        return format_byte_size(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def field_schema(dotted: str, info: FieldInfo) -> dict[str, Any]:
    schema = value_schema(dotted, info.annotation, info.metadata)
    if info.description:
        schema["description"] = info.description
    default = info.get_default(call_default_factory=True)
    if default is not None:
        _type, inner = _unwrap(info.annotation)
        schema["default"] = spec_value(dotted, default, _parser([*info.metadata, *inner]))
    if isinstance(info.json_schema_extra, dict):
        schema.update(info.json_schema_extra)
    schema.update(CRD_ONLY.get(dotted, {}))
    return ordered(schema)


def ordered(schema: dict[str, Any]) -> dict[str, Any]:
    unknown = set(schema) - set(KEY_ORDER)
    if unknown:
        raise ValueError(f"no place in KEY_ORDER for {sorted(unknown)}")
    return {key: schema[key] for key in KEY_ORDER if key in schema}


def section_properties(model: type[BaseModel], dotted: str, left_out: frozenset[str]
                       ) -> dict[str, Any]:
    """The spec properties of a config section, keys in camelCase."""
    prefix = f"{dotted}." if dotted else ""
    return {camel(name): field_schema(prefix + name, info)
            for name, info in model.model_fields.items() if name not in left_out}


def section_model(dotted: str) -> type[BaseModel]:
    model: type[BaseModel] = Config
    for part in dotted.split("."):
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise TypeError(f"{dotted}: {part} is not a section of the config")
        model = annotation
    return model


class _Dumper(yaml.SafeDumper):
    """Block style as in the hand-written parts: sequences indented under their key,
    lists of plain values on one line, long descriptions unbroken."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    plain = all(not isinstance(item, dict | list) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=plain)


_Dumper.add_representer(list, _list)


def section_yaml(section: str, indent: str) -> list[str]:
    """The generated lines of `section`, at `indent`."""
    properties = section_properties(section_model(section), section, SECTIONS[section])
    text = yaml.dump(properties, Dumper=_Dumper, sort_keys=False, width=10_000,
                     default_flow_style=False)
    return [indent + line if line else line for line in text.splitlines()]


def generate(text: str) -> str:
    """The CRD `text` with every generated block written afresh from the model."""
    out: list[str] = []
    lines = iter(text.splitlines())
    done: list[str] = []
    for line in lines:
        out.append(line)
        begin = BEGIN.match(line)
        if begin is None:
            continue
        section, indent = begin["section"], begin["indent"]
        if section not in SECTIONS:
            raise ValueError(f"{line.strip()}: no such section in SECTIONS")
        end = indent + END.format(section=section)
        for old in lines:
            if old == end:
                break
        else:
            raise ValueError(f"{line.strip()}: no `{end.strip()}` after it")
        out.extend(section_yaml(section, indent))
        out.append(end)
        done.append(section)
    if sorted(done) != sorted(SECTIONS):
        raise ValueError(f"each of {sorted(SECTIONS)} needs one generated block; found "
                         f"{sorted(done)}")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str]) -> int:
    """Rewrite the CRD and its chart copy under the folder given (default: here)."""
    root = Path(argv[0]) if argv else Path()
    text = generate((root / CRD_FILE).read_text())
    for path in (CRD_FILE, CHART_COPY):
        (root / path).write_text(text)
        print(f"wrote {root / path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
