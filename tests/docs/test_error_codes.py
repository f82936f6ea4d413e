"""docs/troubleshooting.md documents every error code the code defines, and
names no code the code does not have.

Run by scripts/test.sh (`python3 -m unittest discover -s tests/docs`);
standard library only. The codes are read from the sources:

- node-bin/src/codes.rs: the failure codes of ERROR terminals;
- node-bin/src/attempt/watchdog.rs: `response_stalled` and the codes of a
  run the Node stops (`cancelled`, `session_ended`, `deadline_exceeded`);
- wire/src/close.rs: every connection close reason (`CloseReason::as_str`),
  the `peer:` and `tls_alert:` prefixes included;
- wire/src/lease.rs: the credential lease failure codes;
- edge-bin/src/api/error.rs, plane/client_keys.rs, plane/credentials:
  the `code` of every error the Edge answers, `rate_limit_<kind>` expanded
  with the limit kinds of plane/limits.rs;
- edge-bin/src/client/admin.rs: the codes of the admin API's errors;
- edge-bin/src/control/mod.rs and control/terminal.rs: the cancel reasons
  and the passive-health failure reasons.

A documented code is a backquoted name in the first cell of a table whose
first column is headed `code`.
"""

import re
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCES = ("edge-bin/src", "node-bin/src", "wire/src", "engine/src")


def without_tests(text: str) -> str:
    """The source without its `#[cfg(test)]` module (codes only its tests
    name are not codes a client or a log can show)."""
    cut = text.find("#[cfg(test)]\nmod tests")
    return text if cut < 0 else text[:cut]


def read(rel: str) -> str:
    return without_tests((ROOT / rel).read_text(encoding="utf-8"))


def fn_body(text: str, signature: str) -> str:
    """The text of the function whose header contains `signature`, up to
    the closing brace at the header's indentation."""
    start = text.index(signature)
    line_start = text.rindex("\n", 0, start) + 1
    indent = len(text[line_start:start]) - len(text[line_start:start].lstrip())
    end = text.index("\n" + " " * indent + "}", start)
    return text[start:end]


def literals(text: str) -> set[str]:
    return set(re.findall(r'"([^"\\]+)"', text))


def defined_codes() -> dict[str, set[str]]:
    """Every code the sources define, by where it is defined."""
    found: dict[str, set[str]] = {}

    codes = read("node-bin/src/codes.rs")
    found["node-bin/src/codes.rs"] = set(re.findall(r'pub const \w+: &str = "([^"]+)";', codes))

    watchdog = read("node-bin/src/attempt/watchdog.rs")
    found["node-bin/src/attempt/watchdog.rs"] = (
        set(re.findall(r'pub const FAILURE_\w+: &str = "([^"]+)";', watchdog))
        | literals(fn_body(watchdog, "pub fn failure_code(self)"))
    )

    close = read("wire/src/close.rs")
    body = fn_body(close, "pub fn as_str(&self)")
    prefixes = dict(re.findall(r'const (\w+_PREFIX): &str = "([^"]+)";', close))
    found["wire/src/close.rs"] = set(re.findall(r'Cow::Borrowed\("([^"]+)"\)', body)) | {
        prefixes[name] for name in re.findall(r"\{(\w+_PREFIX)\}", body)
    }

    lease = read("wire/src/lease.rs")
    found["wire/src/lease.rs"] = literals(fn_body(lease, "pub fn failure_code(&self)"))

    error = read("edge-bin/src/api/error.rs")
    limits = read("edge-bin/src/plane/limits.rs")
    kinds = re.findall(r'LimitKind::\w+ => "([a-z_]+)"', limits)
    edge = (
        set(re.findall(r'code: Some\("([a-z_]+)"\.into\(\)\)', error))
        | set(re.findall(r'provider_failure\(\s*"([a-z_]+)"', error))
        | set(re.findall(r'const JSON_TOO_COMPLEX: &str = "([^"]+)";', error))
    )
    assert 'format!("rate_limit_{limit}")' in error, "the rate-limit codes are no longer rate_limit_<kind>"
    edge |= {f"rate_limit_{kind}" for kind in kinds}
    edge |= set(re.findall(r'unauthenticated\([^;]*?Some\("([a-z_]+)"\)', read("edge-bin/src/plane/client_keys.rs"),
                           re.DOTALL))
    edge |= set(re.findall(r'pub const CREDENTIAL_UNAVAILABLE: &str = "([^"]+)";',
                           read("edge-bin/src/plane/credentials/mod.rs")))
    found["edge-bin (client errors)"] = edge

    admin = read("edge-bin/src/client/admin.rs")
    found["edge-bin/src/client/admin.rs"] = set(re.findall(r'error\(\s*\d{3},\s*"([a-z_]+)"', admin))

    control = read("edge-bin/src/control/mod.rs")
    terminal = read("edge-bin/src/control/terminal.rs")
    found["edge-bin/src/control (cancel and failure reasons)"] = (
        literals(fn_body(control[control.index("impl CancelReason"):], "pub fn as_str(self)"))
        | literals(fn_body(terminal[terminal.index("impl FailureReason"):], "pub fn as_str(self)"))
    )
    return found


def documented_codes(text: str) -> set[str]:
    """The backquoted names in the first cell of every table headed `code`."""
    codes: set[str] = set()
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        first = line.split("|")[1].strip()
        if not in_table:
            in_table = True
            headed_code = first == "code"
            continue
        if headed_code and not set(first) <= set("-: "):
            codes |= set(re.findall(r"`([^`]+)`", first))
    return codes


def in_sources(code: str, corpus: str) -> bool:
    """Whether `code` (a `prefix:<detail>` code by its prefix) is a string
    literal of the sources, or built from a `"prefix{…}"` format and a
    literal suffix."""
    code = re.sub(r"<[^>]*>$", "", code)
    if f'"{code}"' in corpus:
        return True
    for prefix in re.findall(r'"([a-z_:]+)\{', corpus):
        if code.startswith(prefix) and f'"{code[len(prefix):]}"' in corpus:
            return True
    return False


class TroubleshootingDocumentsEveryCode(unittest.TestCase):
    def setUp(self):
        self.documented = documented_codes(PAGE.read_text(encoding="utf-8"))
        # A prefix code (`peer:`) is documented as `peer:<reason>`.
        self.documented_names = {re.sub(r"<[^>]*>$", "", c) for c in self.documented}

    def test_the_sources_define_the_expected_kinds_of_code(self):
        # Guards the extraction itself: were a pattern to stop matching,
        # the test below would pass on an empty set.
        found = defined_codes()
        self.assertIn("provider_tls", found["node-bin/src/codes.rs"])
        self.assertEqual(len(found["node-bin/src/codes.rs"]),
                         read("node-bin/src/codes.rs").count("pub const "))
        self.assertIn("response_stalled", found["node-bin/src/attempt/watchdog.rs"])
        self.assertIn("flow_control_overrun", found["wire/src/close.rs"])
        self.assertIn("peer:", found["wire/src/close.rs"])
        self.assertEqual(
            len(found["wire/src/close.rs"]),
            fn_body(read("wire/src/close.rs"), "pub fn as_str(&self)").count("CloseReason::"),
        )
        self.assertEqual(found["wire/src/lease.rs"],
                         {"lease_missing", "lease_invalid", "lease_expired", "lease_replayed",
                          "lease_scope_mismatch"})
        for code in ("queue_full", "budget_exhausted", "rate_limit_tokens", "json_too_complex",
                     "invalid_api_key", "credential_unavailable", "response_wait_timeout"):
            self.assertIn(code, found["edge-bin (client errors)"])
        self.assertIn("admin_scope_required", found["edge-bin/src/client/admin.rs"])
        self.assertIn("client_write_stall", found["edge-bin/src/control (cancel and failure reasons)"])
        self.assertIn("upstream_5xx", found["edge-bin/src/control (cancel and failure reasons)"])

    def test_every_code_in_the_sources_is_documented(self):
        missing = {
            where: sorted(codes - self.documented_names)
            for where, codes in defined_codes().items()
            if codes - self.documented_names
        }
        self.assertEqual(missing, {}, f"codes missing from the tables of {PAGE.relative_to(ROOT)}")

    def test_every_documented_code_exists_in_the_sources(self):
        corpus = "\n".join(
            without_tests(path.read_text(encoding="utf-8"))
            for top in SOURCES
            for path in sorted((ROOT / top).rglob("*.rs"))
        )
        unknown = sorted(c for c in self.documented if not in_sources(c, corpus))
        self.assertEqual(unknown, [], f"codes in {PAGE.relative_to(ROOT)} that the sources do not define")


if __name__ == "__main__":
    unittest.main()
