"""Keep secrets from the environment out of everything a run logs or prints.

Every string ampflow logs to MLflow (params, tags, the resolved config, JSON artifacts) or prints
goes through `redact()`: the value of any environment variable whose name says it is a secret
(`*TOKEN*`, `*PASSWORD*`, `*SECRET*`, `*API_KEY*`, ...) becomes `***`, and so does the password of
a URI's `user:password@`. A job can therefore use `${oc.env:...}` for credentials safely.
"""

import os
import re
from typing import Any, Mapping, Optional

SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY", re.I)
# A value this long is masked wherever it appears; a shorter one only where it stands alone (not inside a
# longer word or number), so a secret "pw1" masks `experiment: pw1` but not "pw123" or "apw1".
MIN_ANYWHERE_LENGTH = 6
# Switches, not credentials: TOKENIZERS_PARALLELISM=false would otherwise blank every "false" in a config.
NOT_SECRETS = frozenset({"0", "1", "true", "false", "yes", "no", "on", "off", "none", "null"})
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")
MASK = "***"


def secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    environ = os.environ if environ is None else environ
    # Other threads change os.environ while we read it (MLflow's telemetry sets and removes a variable of
    # its own): take the names at once, then skip any that vanished before its value was read.
    found = ((name, environ.get(name)) for name in list(environ))
    values = {value for name, value in found
              if value and SECRET_NAME.search(name) and value.strip().lower() not in NOT_SECRETS}
    return sorted(values, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def redact(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    return _masked(text, secret_values(environ))


def redact_all(value: Any, environ: Optional[Mapping[str, str]] = None) -> Any:
    """`redact` applied to every string inside dicts, lists and tuples (keys included)."""
    return _masked_all(value, secret_values(environ))


def _masked(text: str, secrets: list[str]) -> str:
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    for value in secrets:
        if len(value) >= MIN_ANYWHERE_LENGTH:
            text = text.replace(value, MASK)
        elif value in text:
            text = re.sub(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", MASK, text)
    return text


def _masked_all(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        return _masked(value, secrets)
    if isinstance(value, dict):
        return {_masked_all(k, secrets): _masked_all(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked_all(v, secrets) for v in value)
    return value
