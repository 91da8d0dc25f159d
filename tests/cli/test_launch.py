"""`ft launch <harness>` against a real server, with a fake executable per harness on PATH.

Each fake records its arguments and environment to a JSON file, so the tests see exactly what the harness would:
the cloud credentials gone, the variables and config files that point it at the server. Then each test follows
that configuration the way the harness does (base URL, API flavour, model, key) and makes a real request to the
server with it, so a config that points nowhere fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

import freetoken
from conftest import API_KEY, MAX_MODEL_LEN, SERVED_MODEL_NAME, free_port
from freetoken.cli.launch import HARNESSES, ServedModel, _claude_output_tokens, is_cloud_credential

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11: codex's -c values are TOML

# What a developer's shell may hold: every one must be gone from the harness's environment.
CLOUD_ENV = {
    "ANTHROPIC_API_KEY": "sk-ant-secret-1", "ANTHROPIC_AUTH_TOKEN": "sk-ant-secret-2",
    "ANTHROPIC_BASE_URL": "https://cloud.example/anthropic", "OPENAI_API_KEY": "sk-openai-secret",
    "OPENAI_BASE_URL": "https://cloud.example/openai", "AZURE_OPENAI_API_KEY": "azure-secret",
    "GEMINI_API_KEY": "gem-secret", "GOOGLE_API_KEY": "google-secret", "MISTRAL_API_KEY": "mistral-secret",
    "GROQ_API_KEY": "groq-secret", "XAI_API_KEY": "xai-secret", "OPENROUTER_API_KEY": "or-secret",
    "DEEPSEEK_API_KEY": "ds-secret", "TOGETHER_API_KEY": "together-secret", "FIREWORKS_API_KEY": "fw-secret",
    "AWS_ACCESS_KEY_ID": "AKIASECRET", "AWS_SECRET_ACCESS_KEY": "aws-secret", "AWS_SESSION_TOKEN": "aws-token",
    "CLAUDE_CODE_USE_BEDROCK": "1", "CLAUDE_CODE_USE_VERTEX": "1",
}  # fmt: skip
SECRETS = [v for k, v in CLOUD_ENV.items() if "secret" in v.lower() or "SECRET" in v]

FAKE = """#!{python}
import json, os, sys
with open(os.path.join({dump_dir!r}, {name!r} + ".json"), "w") as f:
    json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
"""


@pytest.fixture
def fake_path(tmp_path: Path) -> tuple[Path, Path]:
    """(bin dir with a fake executable per harness, the dir they dump into)."""
    bin_dir, dump_dir = tmp_path / "bin", tmp_path / "dumps"
    bin_dir.mkdir()
    dump_dir.mkdir()
    for harness in HARNESSES.values():
        exe = bin_dir / harness.executable
        exe.write_text(FAKE.format(python=sys.executable, dump_dir=str(dump_dir), name=harness.name))
        exe.chmod(0o755)
    return bin_dir, dump_dir


def ft_launch(
    *args: str, path: str, cache_dir: Path, extra_env: dict | None = None, shadow: Path | None = None
) -> subprocess.CompletedProcess:
    """`ft launch ARGS` in a subprocess with `path` as PATH; `shadow`, a directory of packages put first on
    PYTHONPATH, stands in for the harnesses' PyPI packages (the real ones may be installed here)."""
    env = {k: v for k, v in os.environ.items() if not is_cloud_credential(k)}
    env.update(CLOUD_ENV)
    env.update(extra_env or {})
    env["PATH"] = path
    env["FREETOKEN_CACHE_DIR"] = str(cache_dir)
    env.pop("FREETOKEN_API_KEY", None)
    package_root = str(Path(freetoken.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [shadow and str(shadow), package_root, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", "launch", *args],
        capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def chat(base: str, key: str, model: str) -> None:
    """One OpenAI chat completion through the configured endpoint (`base` ends in /v1)."""
    r = httpx.post(
        f"{base}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


def follow(name: str, argv: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Read the harness's configuration as it would, make one request with it; return (model, key) it uses."""
    if name == "claude":
        base, key, model = env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"], env["ANTHROPIC_MODEL"]
        for tier in ("OPUS", "SONNET", "HAIKU"):
            assert env[f"ANTHROPIC_DEFAULT_{tier}_MODEL"] == model
        assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(MAX_MODEL_LEN)  # else it assumes 1M for an unknown id
        # within the server's cap (here the context): Claude Code's own 32000 would be a 400 on every request
        assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(MAX_MODEL_LEN)
        r = httpx.post(
            f"{base}/v1/messages",
            timeout=60,
            headers={"Authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"},
            json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        return model, key
    if name == "codex":
        overrides, rest = {}, iter(argv[1:])
        for flag in rest:
            if flag != "-c":
                break
            key, _, value = next(rest).partition("=")
            overrides[key] = tomllib.loads(f"v = {value}")["v"]  # codex parses -c values as TOML
        assert overrides["model_provider"] == "freetoken"
        assert overrides["model_context_window"] == MAX_MODEL_LEN
        assert overrides["model_providers.freetoken.wire_api"] == "responses"
        base = overrides["model_providers.freetoken.base_url"]
        key, model = env[overrides["model_providers.freetoken.env_key"]], overrides["model"]
        r = httpx.post(
            f"{base}/responses",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
            json={"model": model, "input": "hi", "max_output_tokens": 2},
        )
        assert r.status_code == 200, r.text
        return model, key
    if name == "opencode":
        config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
        provider_id, model = config["model"].split("/", 1)
        provider = config["provider"][provider_id]
        assert provider["npm"] == "@ai-sdk/openai-compatible"
        assert provider["models"][model]["limit"] == {"context": MAX_MODEL_LEN, "output": MAX_MODEL_LEN}
        key_ref = provider["options"]["apiKey"]
        key = env[key_ref.removeprefix("{env:").removesuffix("}")]
        chat(provider["options"]["baseURL"], key, model)
        return model, key
    if name == "openclaw":
        config = json.loads(Path(env["OPENCLAW_CONFIG_PATH"]).read_text())
        provider_id, model = config["agents"]["defaults"]["model"]["primary"].split("/", 1)
        provider = config["models"]["providers"][provider_id]
        assert provider["api"] == "openai-completions"
        card = next(m for m in provider["models"] if m["id"] == model)
        assert card["contextWindow"] == MAX_MODEL_LEN and card["maxTokens"] == MAX_MODEL_LEN
        key = env[provider["apiKey"].removeprefix("${").removesuffix("}")]
        chat(provider["baseUrl"], key, model)
        return model, key
    if name == "hermes":
        config = yaml.safe_load((Path(env["HERMES_HOME"]) / "config.yaml").read_text())["model"]
        assert config["provider"] == "custom" and config["context_length"] == MAX_MODEL_LEN
        chat(config["base_url"], config["api_key"], config["default"])
        return config["default"], config["api_key"]
    if name == "dsh":
        assert argv[1] == "web" and "--patch" in argv
        patch = yaml.safe_load(Path(argv[argv.index("--patch") + 1]).read_text())
        assert patch[0]["id"] == "settings"
        settings = yaml.safe_load(Path(patch[0]["config"]["path"]).read_text())
        selected = settings["agent-default-model"]
        provider = settings["llm-pi-ai"]["providers"][selected["provider"]]
        assert provider["api"] == "openai-completions"
        assert next(m for m in provider["models"] if m["id"] == selected["model"])["contextWindow"] == MAX_MODEL_LEN
        key = env[provider["apiKeyEnv"]]
        chat(provider["baseURL"], key, selected["model"])
        return selected["model"], key
    raise AssertionError(f"no check for {name}")


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_launch_points_the_harness_at_the_server(name, server, fake_path, tmp_path):
    bin_dir, dump_dir = fake_path
    result = ft_launch(
        name,
        "--server",
        server.base_url,
        "--",
        "--user-flag",
        "value with space",
        path=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        cache_dir=tmp_path / "cache",
    )
    assert result.returncode == 0, result.stderr
    dump = json.loads((dump_dir / f"{name}.json").read_text())
    argv, env = dump["argv"], dump["env"]
    assert argv[0] == str(bin_dir / HARNESSES[name].executable)  # PATH first, before any bundled binary
    assert "--user-flag" in argv and "value with space" in argv
    for var, value in CLOUD_ENV.items():
        assert env.get(var) != value, f"{var} reached {name}"
    leaked = [k for k in env if is_cloud_credential(k) and not (name == "claude" and k.startswith("ANTHROPIC_"))]
    assert not leaked
    model, key = follow(name, argv, env)
    assert model == SERVED_MODEL_NAME and key == "freetoken"
    assert "cloud credentials removed" in result.stderr


def test_claude_gets_the_servers_key(keyed_server, fake_path, tmp_path):
    bin_dir, dump_dir = fake_path
    result = ft_launch(
        "claude",
        "--server",
        keyed_server.base_url,
        path=str(bin_dir),
        cache_dir=tmp_path,
        extra_env={"FREETOKEN_API_KEY": ""},
    )
    assert result.returncode == 1 and "needs its API key" in result.stderr
    result = ft_launch(
        "claude", "--server", keyed_server.base_url, "--api-key", API_KEY, path=str(bin_dir), cache_dir=tmp_path
    )
    assert result.returncode == 0, result.stderr
    env = json.loads((dump_dir / "claude.json").read_text())["env"]
    assert env["ANTHROPIC_AUTH_TOKEN"] == API_KEY and "ANTHROPIC_API_KEY" not in env
    follow("claude", ["claude"], env)


def test_dry_run_masks_and_runs_nothing(server, fake_path, tmp_path):
    bin_dir, dump_dir = fake_path
    result = ft_launch(
        "opencode",
        "--server",
        server.base_url,
        "--dry-run",
        "--api-key",
        "local-key-123",
        path=str(bin_dir),
        cache_dir=tmp_path / "cache",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for var in CLOUD_ENV:
        assert f"remove {var}" in out
    assert "set    OPENCODE_CONFIG=" in out and "FREETOKEN_API_KEY=<13 chars masked>" in out
    assert f"exec   {bin_dir / 'opencode'}" in out and "write  " in out
    for secret in [*SECRETS, "local-key-123"]:
        assert secret not in out and secret not in result.stderr
    assert not list(dump_dir.iterdir()) and not (tmp_path / "cache").exists()


def shadow_package(root: Path, harness: str, executable: str | None) -> None:
    """A stand-in for `harness`'s PyPI package under `root`: its module, with a fake executable at the bundled
    path (`executable`, the fake's name), or without one (None: a package whose binary is missing)."""
    bundled = HARNESSES[harness].bundled
    package = root / bundled.module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('ft launch must not import the package')\n")
    if executable is not None:
        exe = package / bundled.executable
        exe.parent.mkdir(parents=True, exist_ok=True)
        exe.write_text(FAKE.format(python=sys.executable, dump_dir=str(root), name=executable))
        exe.chmod(0o755)
        if bundled.path_dir:
            (package / bundled.path_dir).mkdir()


@pytest.mark.parametrize("name", ["claude", "codex"])
def test_harness_not_installed(name, server, tmp_path):
    """Neither on PATH nor bundled (a package without its binary shadows any real one): one line naming the pip
    package."""
    shadow_package(tmp_path / "shadow", name, None)
    result = ft_launch(
        name, "--server", server.base_url, path=str(tmp_path), cache_dir=tmp_path, shadow=tmp_path / "shadow"
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "not installed" in lines[0] and f"pip install {HARNESSES[name].bundled.package}" in lines[0]


@pytest.mark.parametrize("name", ["claude", "codex"])
def test_bundled_binary_when_not_on_path(name, server, tmp_path):
    """Not on PATH: the binary the PyPI package bundles is run, pointed at the server (Codex with the package's
    helper directory first on its PATH)."""
    shadow = tmp_path / "shadow"
    shadow_package(shadow, name, name)
    result = ft_launch(
        name, "--server", server.base_url, "--", "hi", path=str(tmp_path / "empty"), cache_dir=tmp_path, shadow=shadow
    )
    assert result.returncode == 0, result.stderr
    dump = json.loads((shadow / f"{name}.json").read_text())
    bundled = HARNESSES[name].bundled
    assert dump["argv"][0] == str(shadow / bundled.module / bundled.executable) and dump["argv"][-1] == "hi"
    path = dump["env"]["PATH"].split(os.pathsep)
    if bundled.path_dir:
        assert path == [str(shadow / bundled.module / bundled.path_dir), str(tmp_path / "empty")]
    else:
        assert path == [str(tmp_path / "empty")]
    model, key = follow(name, dump["argv"], dump["env"])
    assert model == SERVED_MODEL_NAME and key == "freetoken"


def test_server_not_running(fake_path, tmp_path):
    bin_dir, dump_dir = fake_path
    result = ft_launch("claude", "--server", f"http://127.0.0.1:{free_port()}", path=str(bin_dir), cache_dir=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "no freetoken server" in lines[0] and "ft serve --model" in lines[0]
    assert not list(dump_dir.iterdir())


def test_credential_list():
    for name in CLOUD_ENV:
        assert is_cloud_credential(name), name
    for name in ("PATH", "HOME", "FREETOKEN_API_KEY", "TERM", "OPENCODE_CONFIG", "AWS_CA_BUNDLE", "AWS_REGION"):
        assert not is_cloud_credential(name), name  # AWS settings that authenticate nothing stay (the aws CLI)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        assert is_cloud_credential(name), name


def test_dry_run_masks_secrets_not_limits():
    from freetoken.cli.launch import mask

    assert mask("ANTHROPIC_AUTH_TOKEN", "abc") == mask("OPENAI_API_KEY", "abc") == "<3 chars masked>"
    assert mask("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "64") == "64" and mask("OPENCODE_CONFIG", "/x") == "/x"


@pytest.mark.parametrize(
    ("cap", "user", "want"),
    [
        (64, None, 64),  # the server's cap below Claude Code's 32000: every request would be a 400
        (262_144, None, 32_000),  # a cap above it: Claude Code's own default
        (64, "32", 32),  # the user's smaller value stays
        (64, "4096", 64),  # a larger one is cut to the cap
        (64, "lots", 64),  # not a number: as if unset
    ],
)
def test_claude_output_limit_stays_within_the_servers_cap(cap, user, want, monkeypatch):
    if user is None:
        monkeypatch.delenv("CLAUDE_CODE_MAX_OUTPUT_TOKENS", raising=False)
    else:
        monkeypatch.setenv("CLAUDE_CODE_MAX_OUTPUT_TOKENS", user)
    served = ServedModel("http://127.0.0.1:1919", "m", 65_536, "k", cap)
    assert _claude_output_tokens(served) == want
