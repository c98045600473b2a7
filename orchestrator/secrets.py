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
MIN_SECRET_LENGTH = 6  # shorter values ("1", "true", "none") would blank out ordinary text
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")
MASK = "***"


def secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    environ = os.environ if environ is None else environ
    values = {value for name, value in environ.items() if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def redact(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    for value in secret_values(environ):
        text = text.replace(value, MASK)
    return text


def redact_all(value: Any, environ: Optional[Mapping[str, str]] = None) -> Any:
    """`redact` applied to every string inside dicts, lists and tuples (keys included)."""
    if isinstance(value, str):
        return redact(value, environ)
    if isinstance(value, dict):
        return {redact_all(k, environ): redact_all(v, environ) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_all(v, environ) for v in value)
    return value
