"""Per-job tokens made and verified with the operator's secret (gradstar.transport.job_tokens),
the settings that ask for one, and ``gradstar admin job-token`` (offline, no coordinator)."""

from __future__ import annotations

import hmac

import pytest

from gradstar.cli import main
from gradstar.config import CoordinatorSettings
from gradstar.errors import ConfigurationError
from gradstar.transport import job_tokens
from gradstar.transport.job_tokens import JobSecret, load_job_secret

SECRET = JobSecret(b"0123456789abcdef-operator-secret")
OTHER = JobSecret(b"0123456789abcdef-another-secret!")
NAMES = ["team-a", "a.b.c", "équipe-ü", "训练作业", "job 🚀 with space", "x" * 256]


@pytest.mark.parametrize("job", NAMES)
def test_a_token_names_its_job_and_only_its_own_secret_verifies_it(job):
    token = SECRET.token_for(job)

    assert token.startswith("gsjob1.") and token.isascii() and token.count(".") == 2
    assert SECRET.job_of(token) == job
    assert OTHER.job_of(token) is None
    assert SECRET.token_for(job) == token  # derived, not drawn: every server agrees


def test_each_job_has_its_own_token():
    tokens = {SECRET.token_for(job) for job in NAMES}

    assert len(tokens) == len(NAMES)


def test_a_token_with_another_jobs_name_is_refused():
    _, _, mac_a = SECRET.token_for("team-a").split(".")
    _, name_b, _ = SECRET.token_for("team-b").split(".")

    assert SECRET.job_of(f"gsjob1.{name_b}.{mac_a}") is None


@pytest.mark.parametrize("position", [0, 10, -1])
def test_a_token_with_an_altered_mac_is_refused(position):
    prefix, name, mac = SECRET.token_for("team-a").split(".")
    flipped = "A" if mac[position] != "A" else "B"
    mac = mac[:position] + flipped + (mac[position + 1:] if position != -1 else "")

    assert SECRET.job_of(f"{prefix}.{name}.{mac}") is None


def test_a_truncated_or_padded_token_is_refused():
    token = SECRET.token_for("team-a")

    assert SECRET.job_of(token[:-1]) is None
    assert SECRET.job_of(token + "=") is None  # another spelling of the same bytes: refused
    assert SECRET.job_of(token + "A") is None


@pytest.mark.parametrize("garbage", [
    "", "gsjob1", "gsjob1..", "gsjob1.dGVhbS1h.", "gsjob1..AAAA", "gsjob2.dGVhbS1h.AAAA",
    "a.b.c.d", "job-token", "Bearer gsjob1.dGVhbS1h.AAAA", "gsjob1.é.ü", "gsjob1.!!!!.????",
    "gsjob1.dGVhbS1h.AAAA.extra", "gsjob1." + "A" * 100_000 + ".AAAA", "\x00\xff",
])
def test_garbage_is_no_token_and_raises_nothing(garbage):
    assert SECRET.job_of(garbage) is None


def test_a_job_name_that_is_not_utf8_under_a_valid_mac_is_refused():
    # Only the secret's holder could make such a token; it still names no job.
    raw = b"\xff\xfe"
    mac = hmac.new(SECRET._key, job_tokens.DOMAIN + raw, "sha256").digest()
    token = f"gsjob1.{job_tokens._encode(raw)}.{job_tokens._encode(mac)}"

    assert SECRET.job_of(token) is None


def test_the_mac_is_compared_in_constant_time(monkeypatch):
    compared = []
    real = hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(job_tokens.hmac, "compare_digest", compare_digest)
    assert SECRET.job_of(SECRET.token_for("team-a")) == "team-a"
    assert SECRET.job_of(OTHER.token_for("team-a")) is None

    assert len(compared) == 2


def test_the_secret_never_shows_in_a_repr():
    assert "operator" not in repr(SECRET)


@pytest.mark.parametrize("job", ["", "x" * 1025, "é" * 513])
def test_no_token_is_made_for_an_empty_or_huge_name(job):
    with pytest.raises(ConfigurationError, match="job name of 1 to 1024 bytes"):
        SECRET.token_for(job)


def test_a_secret_file_is_read_stripped(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef-operator-secret\n")

    assert load_job_secret(path).token_for("j") == SECRET.token_for("j")
    assert load_job_secret(None) is None


@pytest.mark.parametrize(("content", "why"), [
    (b"", "is empty"), (b" \n\t", "is empty"), (b"short", "at least 16 bytes, got 5"),
    (None, "cannot read the job secret file"),
])
def test_an_empty_short_or_missing_secret_file_is_refused(tmp_path, content, why):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)

    with pytest.raises(ConfigurationError, match=why):
        load_job_secret(path)


def test_a_job_secret_protects_every_interface_but_needs_an_admin_or_shared_token(tmp_path):
    secret = tmp_path / "secret"
    CoordinatorSettings(host="0.0.0.0", job_secret_file=secret,
                        admin_token="admin-9f3a").check_protected()
    CoordinatorSettings(host="0.0.0.0", job_secret_file=secret,
                        token="shared-9f3a").check_protected()
    with pytest.raises(ConfigurationError, match="needs an admin token"):
        CoordinatorSettings(host="127.0.0.1", job_secret_file=secret).check_protected()


def test_admin_job_token_prints_the_jobs_token_offline(tmp_path, capsys):
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcdef-operator-secret\n")

    code = main(["admin", "job-token", "--job", "équipe-ü", "--job-secret-file", str(path)])

    assert code == 0
    assert SECRET.job_of(capsys.readouterr().out.strip()) == "équipe-ü"


def test_admin_job_token_without_a_job_or_with_an_empty_secret_is_a_usage_error(tmp_path,
                                                                                capsys,
                                                                                monkeypatch):
    monkeypatch.delenv("GRADSTAR_JOB_SECRET_FILE", raising=False)
    path = tmp_path / "secret"
    path.write_bytes(b"\n")

    assert main(["admin", "job-token", "--job-secret-file", str(path)]) == 2
    assert "name the job with --job" in capsys.readouterr().err
    assert main(["admin", "job-token", "--job", "j", "--job-secret-file", str(path)]) == 2
    assert f"the job secret file {path} is empty" in capsys.readouterr().err
