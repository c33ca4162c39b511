"""Secrets out of evidence: what a trainer prints or runs with may hold credentials, and a
fault's evidence (last lines, command lines) goes to the arbiter, its timeline, history and
``ftagent report``, readable by anyone who may read the job. Pure, and linear: every
pattern is anchored on a literal and its quantifiers are bounded.

Shapes redacted (the value becomes ``[redacted]``, the name stays so the reader knows what
was there):

* ``KEY=VALUE`` whose key names a token, secret, password, key or credential
  (``HF_TOKEN=...``, ``--db-password=...``);
* a flag naming one, then its value as the next word (``--token X``, ``-p`` is not: too
  short to say) -- not flags that name a file, path or directory (``--token-file F``);
* ``Authorization: Bearer X`` (any scheme, or none), and a bare ``Bearer X``;
* credentials in a URL: ``scheme://user:PASSWORD@host``.

The trainer's own output is never touched: only the copies that become evidence.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ftagent.agent.tee import MAX_LINE  # the tee's cut of one line

REDACTED = "[redacted]"


_SECRET_KEY = re.compile(r"token|secret|pass|key|credential", re.I)  # KEY=VALUE
# a flag names a credential when one of its words (split at - _ .) is one of these
_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "pass", "passphrase",
                           "key", "apikey", "credential", "credentials", "auth", "pat"})
_WORD_SPLIT = re.compile(r"[-_.]")
# ``KEY=VALUE``: the key is at most 128 characters of one class, the value runs to the
# next space (or the closing quote).
_PAIR = re.compile(r"\b([A-Za-z_][A-Za-z0-9_.-]{0,127})=(\"[^\"]*\"|'[^']*'|[^\s\"']+)")
# ``--flag VALUE``: a long flag (or ``-`` and 4+ characters), spaces, a value that is no flag
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][A-Za-z0-9_.-]{0,127}|-[A-Za-z][A-Za-z0-9_.-]{3,127})"
                   r"([ \t]+)(\"[^\"]*\"|'[^']*'|[^\s\"'-][^\s\"']*)")
_AUTH = re.compile(r"\b((?:proxy-)?authorization[\"']?[ \t]*[:=][ \t]*[\"']?)"
                   r"((?:bearer|basic|token|negotiate|digest|aws4-hmac-sha256)[ \t]+)?"
                   r"([^\s\"',]+)", re.I)
_BEARER = re.compile(r"\b(bearer[ \t]+)([A-Za-z0-9._~+/=-]{8,})", re.I)
_URL_CREDENTIALS = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s:/@]{1,256}:)"
                              r"([^\s/@]{1,256})@")


def secret_name(name: str) -> bool:
    """Does a flag name a credential (``--token``, ``--hf-token``, ``--api-key``; not
    ``--max-tokens``, not a file holding one: ``--token-file``)?"""
    words = [w for w in _WORD_SPLIT.split(name.lstrip("-").lower()) if w]
    return bool(words) and words[-1] in _SECRET_WORDS


def redact_secrets(line: str, limit: int = MAX_LINE) -> str:
    """``line`` with the secret values of the shapes above replaced by ``[redacted]``.
    Evidence keeps its bounds: a line the redaction made longer than ``limit`` is cut
    there again, at its end."""
    out = line
    if "=" in out:
        out = _PAIR.sub(lambda m: f"{m.group(1)}={REDACTED}" if _SECRET_KEY.search(m.group(1))
                        else m.group(0), out)
    if "-" in out:
        out = _FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}"
                        if secret_name(m.group(1)) else m.group(0), out)
    lower = out.lower()
    if "authorization" in lower:
        out = _AUTH.sub(lambda m: f"{m.group(1)}{m.group(2) or ''}{REDACTED}", out)
        lower = out.lower()
    if "bearer" in lower:
        out = _BEARER.sub(lambda m: f"{m.group(1)}{REDACTED}"
                          if m.group(2) != REDACTED else m.group(0), out)
    if "://" in out and "@" in out:
        out = _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{REDACTED}@", out)
    return out if len(out) <= max(len(line), limit) else out[: max(len(line), limit)]


def redact_lines(lines: Sequence[str], limit: int = MAX_LINE) -> list[str]:
    """Each of ``lines`` (a tail of the trainer's output) as ``redact_secrets`` makes it:
    a tail is redacted in one call, not one per line."""
    return [redact_secrets(line, limit) for line in lines]


def redact_argv(argv: Sequence[str], limit: int = MAX_LINE) -> list[str]:
    """A command line's words with secrets redacted: each word as a line, and the word
    after a flag that names a credential (``--token X``, two words)."""
    out = []
    hide_next = False
    for word in argv:
        if hide_next and not word.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = word.startswith("-") and "=" not in word and len(word.lstrip("-")) > 3 \
            and secret_name(word.lstrip("-"))
        out.append(redact_secrets(word, limit))
    return out
