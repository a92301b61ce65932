"""`pagedq config`: every setting's effective value and where it came from, as a table or
one JSON object. Secrets never appear: pydantic SecretStr values print as asterisks and a
password inside a URL (redis://user:PASSWORD@host) as ***.
"""
from __future__ import annotations

import json
from typing import Any

from pagedq.wire.redis_errors import redact_url
from pagedq.worker.config import SOURCES, Resolved, env_name, flag_name, sections


def _redact(v: Any) -> Any:
    """A URL's password (user:***@, password=***): wire/redis_errors.py's redact_url."""
    return redact_url(v) if isinstance(v, str) and "://" in v else v


def rows(cfg: Resolved) -> list[dict[str, Any]]:
    """One dict per setting, in section order: key, value (JSON types), source, env, flag."""
    dumped = {**cfg.service.model_dump(mode="json"), **cfg.worker.model_dump(mode="json")}
    dumped["served_name"] = cfg.service.model  # the derived name when none was given
    out = []
    for sec, keys in sections().items():
        for key, name in keys.items():
            out.append({"key": f"{sec}.{key}", "value": _redact(dumped[name]),
                        "source": cfg.sources.get(name, "default"), "env": env_name(name),
                        "flag": flag_name(name)})
    return out


def log_config(cfg: Resolved) -> None:
    """One ``worker_config`` log line: the config file and every setting not at its default,
    with its source (passwords redacted as in `pagedq config`)."""
    import structlog

    changed = {r["key"]: f"{_text(r['value'])} ({r['source']})" for r in rows(cfg)
               if r["source"] != "default"}
    structlog.get_logger("pagedq.config").info("worker_config", config_file=cfg.file,
                                               settings=changed)


def _text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):  # as in the environment: PAGEDQ_LANES=interactive,batch
        return ",".join(map(str, v)) if v else "[]"
    return str(v)


def render(cfg: Resolved, as_json: bool = False) -> str:
    table = rows(cfg)
    if as_json:
        return json.dumps({"config_file": cfg.file, "precedence": list(SOURCES),
                           "settings": {r.pop("key"): r for r in table}}, indent=2)
    width = max(len(r["key"]) for r in table)
    vwidth = min(40, max(len(_text(r["value"])) for r in table))
    lines = [f"# config file: {cfg.file or 'none'}; precedence: {' > '.join(SOURCES)}",
             f"{'KEY':<{width}}  {'VALUE':<{vwidth}}  {'SOURCE':<7}  ENV"]
    lines += [f"{r['key']:<{width}}  {_text(r['value']):<{vwidth}}  {r['source']:<7}  {r['env']}"
              for r in table]
    return "\n".join(lines)
