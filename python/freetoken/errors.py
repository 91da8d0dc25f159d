"""The one root of freetoken's errors: every exception freetoken raises on purpose is a `FreetokenError`.

The root is defined by the Rust extension (`freetoken._core.FreetokenError`), so errors raised in Rust
(`OutOfRangeError`, `InvalidArgumentError`, `CheckpointError`, `DeviceTimeoutError`, ...) and in Python
(`ConfigError`, `RequestError`, `ProfileError`, `GrammarError`, `PromptTooLong`, `ApiError`, `ServerError`,
`DriverGaveUpError`, `PinningError`, ...) share it. Each class also derives from the builtin that fits
(`ValueError`, `TimeoutError`, `RuntimeError`...), so callers that catch builtins keep working.
"""

from __future__ import annotations

from freetoken._core import FreetokenError

__all__ = ["FreetokenError"]
