"""Secrets from the environment never reach what a run logs, and reading the environment never fails."""

from collections.abc import Mapping

from orchestrator.tracking.secrets import MASK, redact, redact_all, secret_values


class VanishingEnviron(Mapping):
    """os.environ as another thread changes it: a name listed by iteration is gone when its value is read."""

    def __init__(self, data: dict[str, str], vanishing: str):
        self.data, self.vanishing = data, vanishing

    def __iter__(self):
        return iter([*self.data, self.vanishing])

    def __len__(self):
        return len(self.data) + 1

    def __getitem__(self, name):
        return self.data[name]  # KeyError for the vanished one, as os.environ raises


def test_secret_values_are_masked_longest_first():
    environ = {"HF_TOKEN": "abcdef123", "DB_PASSWORD": "abcdef123456", "SHORT_TOKEN": "ab", "HOME": "/root/abcdef123"}
    assert secret_values(environ) == ["abcdef123456", "abcdef123"]
    assert redact("pw=abcdef123456 tok=abcdef123 home=/root", environ) == f"pw={MASK} tok={MASK} home=/root"


def test_uri_password_and_nested_values_are_masked():
    environ = {"API_KEY": "key-123456"}
    logged = redact_all({"uri": "postgresql://user:pass@db/mlflow", "args": ["--key", "key-123456"],
                         "key-123456": ("x", 1)}, environ)
    assert logged == {"uri": f"postgresql://user:{MASK}@db/mlflow", "args": ["--key", MASK], MASK: ("x", 1)}


def test_a_variable_removed_while_reading_is_skipped():
    environ = VanishingEnviron({"RUN_SECRET": "s3cr3t-value"}, vanishing="_MLFLOW_TELEMETRY_SESSION_ID")
    assert redact_all({"a": "s3cr3t-value"}, environ) == {"a": MASK}
