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
    assert secret_values(environ) == ["abcdef123456", "abcdef123", "ab"]
    assert redact("pw=abcdef123456 tok=abcdef123 home=/root", environ) == f"pw={MASK} tok={MASK} home=/root"


def test_uri_password_and_nested_values_are_masked():
    environ = {"API_KEY": "key-123456"}
    logged = redact_all({"uri": "postgresql://user:pass@db/mlflow", "args": ["--key", "key-123456"],
                         "key-123456": ("x", 1)}, environ)
    assert logged == {"uri": f"postgresql://user:{MASK}@db/mlflow", "args": ["--key", MASK], MASK: ("x", 1)}


def test_a_variable_removed_while_reading_is_skipped():
    environ = VanishingEnviron({"RUN_SECRET": "s3cr3t-value"}, vanishing="_MLFLOW_TELEMETRY_SESSION_ID")
    assert redact_all({"a": "s3cr3t-value"}, environ) == {"a": MASK}


def test_a_short_secret_is_masked_where_it_stands_alone_and_nowhere_else():
    environ = {"AWS_SECRET_ACCESS_KEY": "pw123", "PGPASSWORD": "ab"}
    assert redact("experiment: pw123", environ) == f"experiment: {MASK}"
    assert redact("uri: db://pw123@host/x?k='pw123'", environ) == f"uri: db://{MASK}@host/x?k='{MASK}'"
    assert redact("name: pw123_backup, other: x-ab", environ) == f"name: {MASK}_backup, other: x-{MASK}"
    # Inside an ordinary word it is text, not the secret: "about", "tab", "pw1234" stay.
    assert redact("about the tab pw1234 xpw123", environ) == "about the tab pw1234 xpw123"


def test_a_long_secret_is_masked_even_inside_other_text():
    environ = {"HF_TOKEN": "abcdef123"}
    assert redact("prefix-xabcdef123y", environ) == f"prefix-x{MASK}y"


def test_switches_are_not_secrets():
    # TOKENIZERS_PARALLELISM=false names TOKEN but is a switch: masking every "false" would blank the config.
    environ = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "NO_PASSWORD": "yes"}
    assert secret_values(environ) == []
    assert redact("log_model: false\nepochs: 1\nresume: yes", environ) == "log_model: false\nepochs: 1\nresume: yes"


def test_url_userinfo_without_a_password_is_masked_as_a_token():
    assert redact("git clone https://ghp_abcdef123456@github.com/org/repo.git", {}) == \
        f"git clone https://{MASK}@github.com/org/repo.git"
    assert redact("s3://AKIA123:sEcReT@bucket/data and https://user@host/x", {}) == \
        f"s3://AKIA123:{MASK}@bucket/data and https://{MASK}@host/x"
    assert redact("mail a@b.com, file:///tmp/x, http://host:5000/path", {}) == \
        "mail a@b.com, file:///tmp/x, http://host:5000/path"  # no userinfo: nothing to mask


def test_a_connection_strings_secret_fields_are_masked_inside_longer_text():
    azure = ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Zm9vYmFy+/==;"
             "EndpointSuffix=core.windows.net")
    assert redact(f"data.kwargs.conn={azure}", {}) == \
        f"data.kwargs.conn=DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={MASK};" \
        "EndpointSuffix=core.windows.net"
    assert redact("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey=K3y==", {}) == \
        f"Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=Root;SharedAccessKey={MASK}"
    assert redact("BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=2022&sig=AbC%2F", {}) == \
        f"BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature={MASK}&sig={MASK}"
    assert redact("Server=tcp:db,1433;User ID=ml;Password=hunter2;Encrypt=yes", {}) == \
        f"Server=tcp:db,1433;User ID=ml;Password={MASK};Encrypt=yes"
    assert redact("aws AccessKey=AKIAXYZ SecretKey=abc/def", {}) == f"aws AccessKey={MASK} SecretKey={MASK}"


def test_variables_named_like_keys_dsns_connection_strings_and_credentials_are_secrets():
    environ = {"STORAGE_KEY": "key-value-1", "APP_SECRET": "secret-value-2", "SENTRY_DSN": "dsn-value-3",
               "AZURE_STORAGE_CONNECTION_STRING": "conn-value-4", "GCP_CREDENTIALS": "cred-value-5",
               "KEYBOARD_LAYOUT": "us-intl-layout", "HOME": "/home/user"}
    assert set(secret_values(environ)) == {"key-value-1", "secret-value-2", "dsn-value-3", "conn-value-4",
                                           "cred-value-5"}


def test_a_key_that_names_a_secret_has_its_value_masked_in_yaml_and_in_mappings():
    config = ("data:\n  kwargs:\n    storage_key: abc123\n    password: 'pw'\n    max_tokens: 512\n"
              "    tokenizer: bert\n    use_token: false\n    credentials:\n      region: eu\n")
    assert redact(config, {}) == ("data:\n  kwargs:\n    storage_key: ***\n    password: ***\n    max_tokens: 512\n"
                                  "    tokenizer: bert\n    use_token: false\n    credentials:\n      region: eu\n")
    params = {"data.kwargs.storage_key": "abc123", "data.kwargs.sentry_dsn": "https://k@o.io/1",
              "data.kwargs.max_tokens": "512", "run.epochs": "3"}
    assert redact_all(params, {}) == {"data.kwargs.storage_key": MASK, "data.kwargs.sentry_dsn": MASK,
                                      "data.kwargs.max_tokens": "512", "run.epochs": "3"}


def test_a_mappings_secret_field_is_masked_in_json_python_and_yaml_flow_text_which_stays_what_it_was():
    import json

    text = json.dumps({"hf_token": "hf_abcdef", "port_key": 5, "use_token": False, "grid_unknown_key": {"rc": 2}})
    assert json.loads(redact(text, {})) == {"hf_token": MASK, "port_key": MASK, "use_token": False,
                                            "grid_unknown_key": {"rc": 2}}  # a nested mapping is not a value
    assert redact("cannot build with {'password': 'hunter2', 'depth': 3}", {}) == \
        f"cannot build with {{'password': '{MASK}', 'depth': 3}}"
    assert redact("kwargs: {api_key: k-123, n: 1}", {}) == f"kwargs: {{api_key: {MASK}, n: 1}}"


def test_a_yaml_document_redacted_still_loads(monkeypatch):
    """A value that starts with the mask would be read as a YAML alias (`hf_token: ***`): it is quoted."""
    import yaml

    from orchestrator.tracking.secrets import redact_yaml

    monkeypatch.setenv("AMPFLOW_TEST_TOKEN", "tok-123456")
    document = ("# a comment: kept\nmodel:\n  kwargs:\n    hf_token: hf_abcdef\n    items:\n    - tok-123456 it's\n"
                "    header: Bearer tok-123456\n")
    masked = redact_yaml(document)
    assert masked.startswith("# a comment: kept\n")
    assert yaml.safe_load(masked) == {"model": {"kwargs": {"hf_token": MASK, "items": [f"{MASK} it's"],
                                                           "header": f"Bearer {MASK}"}}}
