"""Keep secrets from the environment out of everything a run logs or prints.

Every string ampflow logs to MLflow (params, tags, the resolved config, JSON artifacts) or prints
goes through `redact()`: the value of any environment variable whose name says it is a secret
(`*TOKEN*`, `*PASSWORD*`, `*SECRET*`, `*API_KEY*`, `*_KEY`, `*_DSN`, `*_CONNECTION_STRING`, ...) becomes
`***`, and so do the password of a URI's `user:password@`, a URI's userinfo without a password
(`https://TOKEN@host`: a bare token) and the values of a connection string's secret fields
(`AccountKey=`, `SharedAccessSignature=`, `Password=`, ...), wherever they come from. A job can
therefore use `${oc.env:...}` for credentials safely.

What other code prints (MLflow's own "View run ... at: <tracking URI>" line, library log records,
tracebacks) is redacted once `install_console_redaction()` has run in the process.
"""

import logging
import os
import re
import sys
import threading
from typing import Any, Mapping, Optional

SECRET_NAME = re.compile(r"TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY|CONNECTION_STRING"
                         r"|_KEY$|(?:^|_)DSN$", re.I)
# A value this long is masked wherever it appears; a shorter one only where it stands alone (not inside a
# longer word or number), so a secret "pw1" masks `experiment: pw1` but not "pw123" or "apw1".
MIN_ANYWHERE_LENGTH = 6
# Switches, not credentials: TOKENIZERS_PARALLELISM=false would otherwise blank every "false" in a config.
NOT_SECRETS = frozenset({"0", "1", "true", "false", "yes", "no", "on", "off", "none", "null"})
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")
# Userinfo without a password is a bare token as often as a user name (`https://ghp_xxx@github.com/...`).
_BARE_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<token>[^:/@\s]+)@")
# A key naming a secret, in `key=value` (a connection string's `AccountKey=...;`, `SharedAccessSignature=`,
# ODBC's `Password=` / `Pwd=`, `access_token=`, `X-Amz-Signature=`, a SAS URL's `sig=`, an override
# `data.kwargs.storage_key=...`), `key: value` (YAML) or a mapping's key (params, JSON): its value is masked.
_SECRET_KEY = (r"[A-Za-z0-9_.-]*?(?:AccountKey|AccessKey|SecretKey|ApiKey|_KEY|SharedAccessSignature|Password|Passwd"
               r"|Pwd|Secret|Token|Signature|Credentials?|DSN|Connection_?String)")
_SECRET_FIELD = re.compile(rf"(?<![A-Za-z0-9_.-])(?P<key>{_SECRET_KEY}|sig)(?P<equals>\s*=\s*)(?P<value>[^;&\s'\",]+)",
                           re.I)
_SECRET_YAML_FIELD = re.compile(rf"^(?P<key>[ \t]*(?:- )?{_SECRET_KEY})(?P<equals>:[ \t]+)(?P<value>[^\s#].*?)[ \t]*$",
                                re.I | re.M)
# The same key in a mapping written out: JSON's `"hf_token": "..."`, Python's `{'password': '...'}` (a dict in an
# error message), YAML's flow style `{api_key: ...}`.
_SECRET_MAPPING_FIELD = re.compile(
    rf"(?P<key>(?P<quote>[\"']){_SECRET_KEY}(?P=quote)|(?<=[{{,])[ \t]*{_SECRET_KEY})(?P<equals>[ \t]*:[ \t]*)"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s,{}\[\]\"'][^\s,}\]]*)", re.I)
_SECRET_KEY_NAME = re.compile(_SECRET_KEY, re.I)
MASK = "***"


# The job's own secrets (`remember_secrets`): masked wherever they appear, as the environment's are.
_remembered: set[str] = set()
# A remembered value shorter than this is masked only where its key or URI shows it: "abc" everywhere would
# blank ordinary words and numbers.
MIN_REMEMBERED_LENGTH = 4


def secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The environment's secrets (`environ`, default os.environ), and with the process's environment those that
    `remember_secrets` found in the job, longest first."""
    remembered = set(_remembered) if environ is None else set()
    environ = os.environ if environ is None else environ
    # Other threads change os.environ while we read it (MLflow's telemetry sets and removes a variable of
    # its own): take the names at once, then skip any that vanished before its value was read.
    found = ((name, environ.get(name)) for name in list(environ))
    values = {value for name, value in found
              if value and SECRET_NAME.search(name) and value.strip().lower() not in NOT_SECRETS} | remembered
    return sorted(values, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def remember_secrets(job: Any) -> None:
    """Mask from now on, in everything this process logs or prints, the secrets a job holds in clear: the value
    of a key that names one (`model.kwargs.hf_token`, `data.kwargs.password`, `api_key`), a URI's password or bare
    token, a connection string's secret field. `job`: a DictConfig, or plain dicts and lists. A job's text may
    show them where no key is beside them (a table of a sweep's points, a library's error message)."""
    if hasattr(job, "_metadata"):  # a DictConfig / ListConfig: its resolved plain form
        from omegaconf import OmegaConf

        job = OmegaConf.to_container(job, resolve=True)
    found: set[str] = set()
    _secrets_in(job, found)
    _remembered.update(value for value in found if len(value) >= MIN_REMEMBERED_LENGTH and _is_secret_value(value))


def _secrets_in(value: Any, found: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if _names_a_secret(key) and isinstance(item, (str, int, float)) and not isinstance(item, bool):
                found.add(str(item))
            _secrets_in(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _secrets_in(item, found)
    elif isinstance(value, str):
        found.update(m["password"] for m in _USERINFO.finditer(value))
        found.update(m["token"] for m in _BARE_USERINFO.finditer(value))
        found.update(m["value"].strip("'\"") for m in _SECRET_FIELD.finditer(value))


def redact(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    return _masked(text, secret_values(environ))


def redact_yaml(text: str) -> str:
    """`redact` for a YAML document, which stays one: a value that now starts with the mask (`hf_token: ***`, a
    list item `- ***`) would be read as a YAML alias, so it is quoted (`hf_token: '***'`) and the document still
    loads (export and predict read a run's job back from its `config/job.yaml`)."""
    return _YAML_MASKED_SCALAR.sub(_quoted_scalar, redact(text))


_YAML_MASKED_SCALAR = re.compile(r"^(?P<lead>[ \t]*(?:- +)*(?:[^\n:#'\"]+: +)?)(?P<value>\*\*\*.*?)[ \t]*$", re.M)


def _quoted_scalar(match: re.Match) -> str:
    return f"{match['lead']}'{match['value'].replace(chr(39), chr(39) * 2)}'"


def redact_all(value: Any, environ: Optional[Mapping[str, str]] = None) -> Any:
    """`redact` applied to every string inside dicts, lists and tuples (keys included)."""
    return _masked_all(value, secret_values(environ))


def _masked(text: str, secrets: list[str]) -> str:
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _BARE_USERINFO.sub(lambda m: m[0] if m["token"] == MASK else f"{m['scheme']}{MASK}@", text)
    text = _SECRET_FIELD.sub(_masked_field, text)
    text = _SECRET_YAML_FIELD.sub(_masked_field, text)
    text = _SECRET_MAPPING_FIELD.sub(_masked_mapping_field, text)
    for value in secrets:
        if len(value) >= MIN_ANYWHERE_LENGTH:
            text = text.replace(value, MASK)
        elif value in text:
            text = re.sub(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", MASK, text)
    return text


def _masked_field(match: re.Match) -> str:
    if not _is_secret_value(match["value"]):
        return match[0]
    return f"{match['key']}{match['equals']}{MASK}"


def _masked_mapping_field(match: re.Match) -> str:
    """As `_masked_field`, the mask quoted as the value or its key was: JSON stays JSON (`"port_key": 5` becomes
    `"port_key": "***"`). A nested mapping or list is structure, not a value: its own fields are looked at."""
    value = match["value"]
    if not _is_secret_value(value):
        return match[0]
    quote = value[0] if value[:1] in ("'", '"') else (match["quote"] or "")
    return f"{match['key']}{match['equals']}{quote}{MASK}{quote}"


def _is_secret_value(value: str) -> bool:
    """Not a switch (`use_token=false`), an empty value or one masked already."""
    return value.strip("'\"").lower() not in NOT_SECRETS | {"", "~", MASK}


def _names_a_secret(key: Any) -> bool:
    """A mapping key (a flattened param's last part) that names a secret: `storage_key`, `db_password`, `dsn`."""
    return isinstance(key, str) and _SECRET_KEY_NAME.fullmatch(key.rsplit(".", 1)[-1]) is not None


def _masked_all(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        return _masked(value, secrets)
    if isinstance(value, dict):
        return {_masked_all(k, secrets): MASK if _names_a_secret(k) and isinstance(v, str) and _is_secret_value(v)
                else _masked_all(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked_all(v, secrets) for v in value)
    return value


class RedactingStream:
    """sys.stdout / sys.stderr, redacted: holds text until a line ends (a secret may come in pieces, as
    `print(a, b)` writes it), then writes the line redacted. Everything else goes to the stream it wraps."""

    def __init__(self, stream):
        self.wrapped, self._pending, self._lock = stream, "", threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            end = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
            if end:
                ready, self._pending = self._pending[:end], self._pending[end:]
                self.wrapped.write(redact(ready))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                ready, self._pending = self._pending, ""
                self.wrapped.write(redact(ready))
        self.wrapped.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...: the wrapped stream's
        if name == "wrapped":  # not set yet (a copy being made): no endless lookup
            raise AttributeError(name)
        return getattr(self.wrapped, name)


_install_lock = threading.Lock()


def install_console_redaction() -> None:
    """Redact everything this process prints or logs, whoever prints it. Idempotent; call it first thing.

    - sys.stdout and sys.stderr are wrapped: `print`, MLflow's "View run ... at: <uri>" line (written to
      sys.stdout by `MlflowClient.set_terminated`), warnings and tracebacks go through `redact`.
    - Every log record is redacted when it is made (message, arguments, exception text), so handlers that
      hold the original stream or write to a file (Ray's, made at import) get the redacted text too.
    Writes to file descriptors 1 and 2 from C code or other processes (Ray workers) are not covered.
    """
    with _install_lock:
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is not None and not isinstance(stream, RedactingStream):
                setattr(sys, name, RedactingStream(stream))
        factory = logging.getLogRecordFactory()
        if not getattr(factory, "redacts", False):
            logging.setLogRecordFactory(_redacting_record_factory(factory))


def _redacting_record_factory(make_record):
    def make(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed call is logging's to report, at emit time
            return record
        secrets = secret_values()
        record.msg, record.args = _masked(message, secrets), None
        if record.exc_info and not record.exc_text:
            # Formatted now, as Formatter would later, so the traceback's text is redacted too.
            record.exc_text = _masked(logging.Formatter().formatException(record.exc_info), secrets)
        if record.stack_info:
            record.stack_info = _masked(record.stack_info, secrets)
        return record

    make.redacts = True
    return make


def redact_figure(figure):
    """Every text a matplotlib figure draws (titles, axis and tick labels, legends, annotations), redacted in place;
    returns the figure. A tick label is made when the figure is drawn, so it is drawn (not rendered) first."""
    from matplotlib.text import Text

    secrets = secret_values()
    figure.draw_without_rendering()
    for axes in figure.get_axes():
        for axis in (axes.xaxis, axes.yaxis):
            labels = [label.get_text() for label in axis.get_ticklabels()]
            masked = [_masked(label, secrets) for label in labels]
            if masked != labels:
                axis.set_ticks(axis.get_ticklocs(), labels=masked)
    for text in figure.findobj(Text):
        masked = _masked(text.get_text(), secrets)
        if masked != text.get_text():
            text.set_text(masked)
    return figure
