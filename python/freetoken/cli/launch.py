"""`ft launch <harness>`: start a coding agent pointed at the running freetoken server.

For each harness, `HARNESSES` says how it is pointed at the server: environment variables, command-line config
overrides, or a config file of its own that freetoken writes under `$FREETOKEN_CACHE_DIR/launch/<harness>/`
(selected by an environment variable or a flag), so the user's own config is never rewritten. The model id,
context length and per-request output cap come from the server's ``GET /v1/models``; each harness's output limit
is set within that cap (a harness asking for more gets a 400 on every request). Every cloud credential
(`CLOUD_CREDENTIAL_PREFIXES`, `CLOUD_CREDENTIALS`) is removed from the child's environment, so the agent cannot fall
back to a paid endpoint without saying so; then the harness replaces this process (`os.execvpe`). The harness's
binary is the command on PATH, else the one a PyPI package bundles (`Bundled`: Claude Code in ``claude-agent-sdk``,
Codex in ``openai-codex-cli-bin``).

Harnesses and what they are given:
    claude    Claude Code: ANTHROPIC_BASE_URL / ANTHROPIC_AUTH_TOKEN / ANTHROPIC_MODEL and the per-tier model names
              (the Anthropic Messages API at /v1/messages), CLAUDE_CODE_MAX_CONTEXT_TOKENS the context length,
              CLAUDE_CODE_MAX_OUTPUT_TOKENS at most the server's per-request output cap.
    codex     Codex CLI: `-c` overrides adding a `freetoken` model provider on /v1/responses (wire_api "responses"),
              its model and context window; the key in FREETOKEN_API_KEY.
    opencode  opencode: OPENCODE_CONFIG -> a config adding an OpenAI-compatible `freetoken` provider.
    openclaw  OpenClaw: OPENCLAW_CONFIG_PATH -> a config with a `freetoken` provider (openai-completions).
    hermes    Hermes Agent: HERMES_HOME -> a home of its own whose config.yaml selects a custom endpoint.
    dsh       DeepSeek Harness: `dsh web --patch FILE`, a patch loading a settings file with a `freetoken` provider.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from freetoken.cli.client import ServerError, add_server_args, base_url, get_json
from freetoken.paths import cache_root

# The key the harness sends when the server has no --api-key: harnesses refuse to start without one.
PLACEHOLDER_KEY = "freetoken"

# Cloud credentials stripped from every harness's environment: whole families by prefix, and single names.
CLOUD_CREDENTIAL_PREFIXES = ("ANTHROPIC_", "OPENAI_", "AZURE_OPENAI_", "AWS_")
CLOUD_CREDENTIALS = frozenset({
    "GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_APPLICATION_CREDENTIALS", "MISTRAL_API_KEY", "GROQ_API_KEY",
    "XAI_API_KEY", "OPENROUTER_API_KEY", "DEEPSEEK_API_KEY", "TOGETHER_API_KEY", "FIREWORKS_API_KEY",
    "COHERE_API_KEY", "MOONSHOT_API_KEY", "KIMI_API_KEY", "DASHSCOPE_API_KEY", "NOUS_API_KEY",
    "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX", "CLAUDE_CODE_USE_FOUNDRY", "CLAUDE_CODE_OAUTH_TOKEN",
    "CODEX_API_KEY",
})  # fmt: skip


# Settings under those prefixes that authenticate nothing (a certificate bundle, a region, output and retry
# options): kept, so that the agent's own tools (the aws CLI in a user's project) still find them.
NOT_CREDENTIALS = frozenset({
    "AWS_CA_BUNDLE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_DEFAULT_OUTPUT", "AWS_PAGER", "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
})  # fmt: skip


def is_cloud_credential(name: str) -> bool:
    """True for an environment variable that `ft launch` removes (see `CLOUD_CREDENTIAL_PREFIXES`)."""
    return (name.startswith(CLOUD_CREDENTIAL_PREFIXES) or name in CLOUD_CREDENTIALS) and name not in NOT_CREDENTIALS


@dataclass(frozen=True)
class ServedModel:
    """What the harness is pointed at.

    Attributes:
        base_url: the server's root, ``http://host:port`` (no ``/v1``).
        model: the served model id (``GET /v1/models``).
        max_model_len: its context length in tokens.
        api_key: the server's key, or `PLACEHOLDER_KEY` when it has none.
        max_output_tokens: the most output tokens one request may ask for (the card's `max_output_tokens`:
            `--max-request-output-tokens` within the context; the context length from a server without it).
    """

    base_url: str
    model: str
    max_model_len: int
    api_key: str
    max_output_tokens: int


@dataclass
class LaunchPlan:
    """What `ft launch` does: set `env`, write `files`, exec `argv`.

    Attributes:
        argv: the harness's command line, `argv[0]` the executable's name.
        env: variables set on top of the stripped environment.
        files: config files to write (path -> text).
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Bundled:
    """Where a Python package from PyPI ships the harness's binary, for when it is not on PATH.

    Attributes:
        package: the pip package (``pip install <package>``).
        module: its top-level import name (found through `sys.path`, not imported).
        executable: the binary's path inside the module's directory.
        path_dir: a directory of helper binaries beside it (Codex's ``rg``) that goes first on the harness's PATH,
            as the package's own launcher does; None when there is none.
    """

    package: str
    module: str
    executable: str
    path_dir: str | None = None


@dataclass(frozen=True)
class Harness:
    """One coding agent `ft launch` knows.

    Attributes:
        name: the `ft launch` argument.
        title: its name for people.
        executable: the command it installs on PATH.
        install: how to install it (one line).
        plan: (served model, the user's extra arguments, this harness's config dir) -> `LaunchPlan`.
        bundled: the PyPI package that also ships it, if one does.
    """

    name: str
    title: str
    executable: str
    install: str
    plan: Callable[[ServedModel, list[str], Path], LaunchPlan]
    bundled: Bundled | None = None


# Claude Code's own output limit per request: its requests ask for max_tokens 32000 (Claude Code 2.1.332, measured
# through `ft serve`), and `CLAUDE_CODE_MAX_OUTPUT_TOKENS` lowers it.
CLAUDE_CODE_DEFAULT_OUTPUT_TOKENS = 32_000


def _claude_output_tokens(served: ServedModel) -> int:
    """Claude Code's output limit under the server's: the user's `CLAUDE_CODE_MAX_OUTPUT_TOKENS` when it is a
    smaller number, else the server's cap when it is below Claude Code's default, else that default. Above the
    server's cap every request of the session would be a 400."""
    wanted = CLAUDE_CODE_DEFAULT_OUTPUT_TOKENS
    with contextlib.suppress(ValueError):
        wanted = int(os.environ.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS", wanted))
    return max(1, min(wanted, served.max_output_tokens))


def _claude(served: ServedModel, args: list[str], _dir: Path) -> LaunchPlan:
    env = {
        "ANTHROPIC_BASE_URL": served.base_url,
        "ANTHROPIC_AUTH_TOKEN": served.api_key,
        "ANTHROPIC_MODEL": served.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": served.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": served.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,
        "ANTHROPIC_SMALL_FAST_MODEL": served.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": served.model,
        # The served context: Claude Code assumes 1M tokens for a model id it does not know (and says so on every
        # start), so it would compact too late and overrun the server's context.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.max_model_len),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(_claude_output_tokens(served)),
        # no telemetry, error reporting or auto-update calls to the cloud
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    return LaunchPlan(["claude", *args], env)


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def _codex(served: ServedModel, args: list[str], _dir: Path) -> LaunchPlan:
    overrides = {
        "model_provider": _toml_string("freetoken"),
        "model": _toml_string(served.model),
        "model_context_window": str(served.max_model_len),
        "model_providers.freetoken.name": _toml_string("freetoken"),
        "model_providers.freetoken.base_url": _toml_string(served.base_url + "/v1"),
        "model_providers.freetoken.wire_api": _toml_string("responses"),
        "model_providers.freetoken.env_key": _toml_string("FREETOKEN_API_KEY"),
    }
    argv = ["codex"]
    for key, value in overrides.items():
        argv += ["-c", f"{key}={value}"]
    return LaunchPlan([*argv, *args], {"FREETOKEN_API_KEY": served.api_key})


def _json(value: object) -> str:
    """A config file's text; JSON is also YAML 1.2, so YAML configs are written without a YAML library."""
    return json.dumps(value, indent=2) + "\n"


def _with_config_file(argv: list[str], served: ServedModel, env_var: str, path: Path, config: dict) -> LaunchPlan:
    """Run `argv` with `config` written to `path`, which `env_var` names; the key goes in FREETOKEN_API_KEY (the
    config refers to it), so it is not written to disk."""
    return LaunchPlan(argv, {env_var: str(path), "FREETOKEN_API_KEY": served.api_key}, {path: _json(config)})


def _opencode(served: ServedModel, args: list[str], config_dir: Path) -> LaunchPlan:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "freetoken": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "freetoken",
                "options": {"baseURL": served.base_url + "/v1", "apiKey": "{env:FREETOKEN_API_KEY}"},
                "models": {
                    served.model: {
                        "name": served.model,
                        "limit": {"context": served.max_model_len, "output": served.max_output_tokens},
                    },
                },
            }
        },
        "model": f"freetoken/{served.model}",
    }
    return _with_config_file(["opencode", *args], served, "OPENCODE_CONFIG", config_dir / "opencode.json", config)


def _openclaw(served: ServedModel, args: list[str], config_dir: Path) -> LaunchPlan:
    config = {
        "models": {
            "mode": "merge",
            "providers": {
                "freetoken": {
                    "baseUrl": served.base_url + "/v1",
                    "apiKey": "${FREETOKEN_API_KEY}",
                    "api": "openai-completions",
                    "models": [
                        {
                            "id": served.model,
                            "name": served.model,
                            "reasoning": False,
                            "input": ["text"],
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                            "contextWindow": served.max_model_len,
                            "maxTokens": served.max_output_tokens,
                        }
                    ],
                }
            },
        },
        "agents": {"defaults": {"model": {"primary": f"freetoken/{served.model}"}}},
    }
    return _with_config_file(["openclaw", *args], served, "OPENCLAW_CONFIG_PATH", config_dir / "openclaw.json", config)


def _hermes(served: ServedModel, args: list[str], config_dir: Path) -> LaunchPlan:
    config = {
        "model": {
            "provider": "custom",
            "default": served.model,
            "base_url": served.base_url + "/v1",
            "api_key": served.api_key,
            "context_length": served.max_model_len,
        },
    }
    home = config_dir / "home"
    return LaunchPlan(["hermes", *args], {"HERMES_HOME": str(home)}, {home / "config.yaml": _json(config)})


def _dsh(served: ServedModel, args: list[str], config_dir: Path) -> LaunchPlan:
    settings_path, patch_path = config_dir / "settings.yaml", config_dir / "freetoken.cordis.yml"
    settings = {
        "agent-default-model": {"provider": "freetoken", "model": served.model},
        "llm-pi-ai": {
            "providers": {
                "freetoken": {
                    "displayName": "freetoken",
                    "api": "openai-completions",
                    "baseURL": served.base_url + "/v1",
                    "apiKeyEnv": "FREETOKEN_API_KEY",
                    "models": [
                        {
                            "id": served.model,
                            "name": served.model,
                            "input": ["text"],
                            "contextWindow": served.max_model_len,
                            "maxTokens": served.max_output_tokens,
                        }
                    ],
                }
            }
        },
    }
    patch = [{"id": "settings", "config": {"path": str(settings_path)}}]
    files = {settings_path: _json(settings), patch_path: _json(patch)}
    # `dsh web` (the Web UI) unless the arguments name another subcommand; --patch goes with either
    subcommand = [] if args and not args[0].startswith("-") else ["web"]
    argv = ["dsh", *subcommand, *args, "--patch", str(patch_path)]
    return LaunchPlan(argv, {"FREETOKEN_API_KEY": served.api_key}, files)


HARNESSES: dict[str, Harness] = {h.name: h for h in (
    Harness("claude", "Claude Code", "claude",
            "pip install claude-agent-sdk (or npm install -g @anthropic-ai/claude-code)", _claude,
            Bundled("claude-agent-sdk", "claude_agent_sdk", "_bundled/claude")),
    Harness("codex", "Codex CLI", "codex", "pip install openai-codex-cli-bin (or npm install -g @openai/codex)", _codex,
            Bundled("openai-codex-cli-bin", "codex_cli_bin", "bin/codex", "codex-path")),
    Harness("opencode", "opencode", "opencode", "npm install -g opencode-ai", _opencode),
    Harness("openclaw", "OpenClaw", "openclaw", "npm install -g openclaw", _openclaw),
    Harness("hermes", "Hermes Agent", "hermes", "the install script in github.com/NousResearch/hermes-agent's README",
            _hermes),
    Harness("dsh", "DeepSeek Harness", "dsh", "npm install -g @deepseek-ai/dsh", _dsh),
)}  # fmt: skip


def discover(server: str, api_key: str | None) -> ServedModel:
    """The served model from ``GET {server}/v1/models``.

    Raises:
        ServerError: the server is down (the message names the `ft serve` command), refuses the key, or does not
            list a model with its context length.
    """
    body = get_json(server, "/v1/models", api_key)
    try:
        card = body["data"][0]
        max_model_len = int(card["max_model_len"])
        return ServedModel(
            base_url(server),
            str(card["id"]),
            max_model_len,
            api_key or PLACEHOLDER_KEY,
            int(card.get("max_output_tokens") or max_model_len),
        )
    except (KeyError, IndexError, TypeError, ValueError):
        raise ServerError(
            f"{base_url(server)}/v1/models lists no model with max_model_len; is it a freetoken server?"
        ) from None


@dataclass(frozen=True)
class Found:
    """An installed harness binary.

    Attributes:
        executable: its absolute path.
        path_dir: a directory to put first on the harness's PATH (a bundled package's helpers), or None.
    """

    executable: str
    path_dir: str | None = None


def find_harness(harness: Harness) -> Found | None:
    """The harness's binary: the command on PATH first, then the one its PyPI package bundles (`Harness.bundled`,
    located through `sys.path` without importing the package); None when neither is installed."""
    on_path = shutil.which(harness.executable)
    if on_path is not None:
        return Found(on_path)
    bundled = harness.bundled
    if bundled is None:
        return None
    try:
        spec = importlib.util.find_spec(bundled.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in map(Path, spec.submodule_search_locations):
        executable = root / bundled.executable
        if executable.is_file() and os.access(executable, os.X_OK):
            path_dir = root / bundled.path_dir if bundled.path_dir else None
            return Found(str(executable), str(path_dir) if path_dir and path_dir.is_dir() else None)
    return None


def child_env(parent: Mapping[str, str], plan: LaunchPlan) -> tuple[dict[str, str], list[str]]:
    """(the harness's environment, the names removed): `parent` less every cloud credential, plus `plan.env`."""
    removed = sorted(name for name in parent if is_cloud_credential(name))
    env = {name: value for name, value in parent.items() if not is_cloud_credential(name)}
    env.update(plan.env)
    return env, removed


# Words of a variable name (split at "_") that mark its value as a secret.
SECRET_WORDS = frozenset({"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIALS"})


def mask(name: str, value: str) -> str:
    """`value` for display: secrets (a name with the word KEY, TOKEN, SECRET, PASSWORD or CREDENTIALS) show their
    length only; a limit such as CLAUDE_CODE_MAX_OUTPUT_TOKENS shows as it is."""
    if SECRET_WORDS & set(name.upper().split("_")):
        return f"<{len(value)} chars masked>"
    return value


def describe(plan: LaunchPlan, removed: list[str], executable: str | None) -> str:
    """The `--dry-run` report: variables removed and set (masked), files written, the command (the binary found,
    `executable`, or its name when None)."""
    lines = [f"remove {name}" for name in removed]
    lines += [f"set    {name}={mask(name, value)}" for name, value in sorted(plan.env.items())]
    lines += [f"write  {path}" for path in plan.files]
    command = " ".join(shlex.quote(a) for a in [executable or plan.argv[0], *plan.argv[1:]])
    lines.append(f"exec   {command}" + ("" if executable else "   (not installed)"))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `ft launch` and its flags to the subcommands of `ft` (`freetoken.cli.main.build_parser`)."""
    p = sub.add_parser(
        "launch",
        usage="ft launch [-h] [--server SERVER] [--api-key API_KEY] [--dry-run] HARNESS [-- ARGS...]",
        help="start a coding agent pointed at the running server",
        description="Point a coding agent at the running freetoken server and start it: " + ", ".join(
            f"{h.name} ({h.title})" for h in HARNESSES.values()
        ) + ". Cloud credentials (ANTHROPIC_*, OPENAI_*, AWS_*, ...) are removed from its environment. Arguments "
        "after -- go to the agent.",
    )  # fmt: skip
    p.add_argument("harness", choices=sorted(HARNESSES), metavar="HARNESS", help=", ".join(sorted(HARNESSES)))
    add_server_args(p)
    p.add_argument("--dry-run", action="store_true", help="print what would be set, removed, written and run")
    p.set_defaults(func=run, parser=p, takes_passthrough=True)


def run(args: argparse.Namespace) -> int:
    """Discover the served model, build the harness's plan, and exec it (or print it with --dry-run)."""
    harness = HARNESSES[args.harness]
    extra = args.passthrough  # what followed `--` (split off by `ft`'s main)
    found = find_harness(harness)
    if found is None and not args.dry_run:
        print(
            f"ft launch: {harness.title} (`{harness.executable}`) is not installed; install it with: {harness.install}",
            file=sys.stderr,
        )
        return 1
    try:
        served = discover(args.server, args.api_key)
    except ServerError as exc:
        print(f"ft launch: {exc}", file=sys.stderr)
        return 1
    plan = harness.plan(served, extra, cache_root() / "launch" / harness.name)
    if found is not None and found.path_dir is not None:
        plan.env["PATH"] = os.pathsep.join(filter(None, [found.path_dir, os.environ.get("PATH")]))
    env, removed = child_env(os.environ, plan)
    if args.dry_run:
        print(describe(plan, removed, found.executable if found else None))
        return 0
    for path, text in plan.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if "api_key" in text or "apiKey" in text:
            path.chmod(0o600)
    print(
        f"ft launch: {harness.title} on {served.model} at {served.base_url}"
        + (f" ({len(removed)} cloud credential{'s' if len(removed) > 1 else ''} removed)" if removed else ""),
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    assert found is not None  # not installed returned above
    os.execvpe(found.executable, [found.executable, *plan.argv[1:]], env)
    return 0  # not reached
