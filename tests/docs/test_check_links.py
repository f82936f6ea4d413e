"""scripts/check-links.py finds exactly the broken links of a small tree.

Run by scripts/test.sh (`python3 -m unittest discover -s tests/docs`);
standard library only.
"""

import importlib.util
import tempfile
import textwrap
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_links", ROOT / "scripts" / "check-links.py")
check_links = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_links)


def tree(files: dict[str, str]) -> Path:
    root = Path(tempfile.mkdtemp(prefix="iop-links-"))
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


class Slugs(unittest.TestCase):
    def test_github_anchor_rules(self):
        for heading, slug in [
            ("The client listener (`[edge.client_tls]`)", "the-client-listener-edgeclient_tls"),
            ("Readiness: what `READY=1` means", "readiness-what-ready1-means"),
            ("Providers behind `https://`", "providers-behind-https"),
            ("A vLLM node, and other OpenAI-compatible servers", "a-vllm-node-and-other-openai-compatible-servers"),
            ("Edge + Node → nginx ÷ 2", "edge--node--nginx--2"),
            ("[Linked](x.md) heading", "linked-heading"),
            ("Ünïcode letters stay", "ünïcode-letters-stay"),
        ]:
            self.assertEqual(check_links.slug_base(heading), slug, heading)

    def test_repeated_headings_are_numbered(self):
        page = check_links.Page(Path("x.md"), "# A\n## Notes\n## Notes\n## Notes\n")
        self.assertEqual(page.anchors, {"a", "notes", "notes-1", "notes-2"})


class Check(unittest.TestCase):
    def test_a_sound_tree_passes(self):
        root = tree({
            "README.md": """\
                # Top
                [manual](docs/README.md), [b](docs/b.md#second-part), [self](#top),
                [dir](docs/), ![img](docs/pic.png), <https://example.com/x>,
                [ext](https://github.com/bytedance/monoio "title")

                [ref]: docs/b.md#b
                """,
            "docs/README.md": "# Index\n[b](b.md)\n",
            "docs/b.md": "# B\n## Second part\n[up](../README.md#top)\n",
            "docs/pic.png": "",
        })
        problems, links, pages = check_links.check(root)
        self.assertEqual(problems, [])
        self.assertEqual((links, pages), (10, 3))

    def test_every_kind_of_broken_link_is_reported(self):
        root = tree({
            "README.md": """\
                # Top
                [gone](docs/gone.md) and [anchor](docs/b.md#nowhere)
                [here](#missing) [out](../../etc/passwd) [url](https:example.com)
                [no host](https:///path) [scheme](ftp://example.com/x)
                [anchor on a file](docs/pic.png#x)

                Code is text: `[not](a-link.md)` and

                ```sh
                [neither](fenced.md)
                ```
                """,
            "docs/README.md": "# Index\n",
            "docs/b.md": "# B\n",
            "docs/pic.png": "",
        })
        problems, _, _ = check_links.check(root)
        self.assertEqual(problems, [
            "README.md:2: 'docs/gone.md': no such file or directory",
            "README.md:2: 'docs/b.md#nowhere': no heading with the anchor #nowhere in docs/b.md",
            "README.md:3: '#missing': no heading with the anchor #missing in README.md",
            "README.md:3: '../../etc/passwd' leaves the repository",
            "README.md:3: malformed URL 'https:example.com'",
            "README.md:4: malformed URL 'https:///path'",
            "README.md:4: unsupported link scheme in 'ftp://example.com/x'",
            "README.md:5: 'docs/pic.png#x': an anchor on something that is not a Markdown file",
            "docs/b.md: not reachable from docs/README.md",
        ])

    def test_a_page_reached_only_from_outside_docs_is_unreachable(self):
        root = tree({
            "README.md": "# Top\n[c](docs/c.md)\n",
            "docs/README.md": "# Index\n[d](sub/d.md)\n",
            "docs/c.md": "# C\n",
            "docs/sub/d.md": "# D\n",
        })
        problems, _, _ = check_links.check(root)
        self.assertEqual(problems, ["docs/c.md: not reachable from docs/README.md"])


if __name__ == "__main__":
    unittest.main()
