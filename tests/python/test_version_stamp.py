"""tools/cmake/version.cmake, which the build runs before every build: mxscope/version.hpp names
the source tree's current commit (so a build made after a new commit reports it), is left untouched
(same modification time) while the commit stays the same, and says "unknown" outside a git
checkout."""
import os
import pathlib
import subprocess
import tempfile
import time
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "cmake" / "version.cmake"
TEMPLATE = ROOT / "include" / "mxscope" / "version.hpp.in"


def stamp(source, out):
    subprocess.run(["cmake", f"-DTEMPLATE={TEMPLATE}", f"-DOUT={out}", "-DVERSION=1.2.3", f"-DSOURCE_DIR={source}",
                    "-P", str(SCRIPT)], check=True, capture_output=True)
    return out.read_text()


def git(repo, *arguments):
    environment = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                       GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *arguments], cwd=repo, check=True, capture_output=True, text=True,
                          env=environment).stdout.strip()


class VersionStampTest(unittest.TestCase):
    def test_the_stamp_follows_the_commit(self):
        with tempfile.TemporaryDirectory() as d:
            repo, out = pathlib.Path(d, "repo"), pathlib.Path(d, "version.hpp")
            repo.mkdir()
            git(repo, "init", "-q")
            git(repo, "commit", "-q", "--allow-empty", "-m", "one")
            first = git(repo, "rev-parse", "--short=12", "HEAD")
            text = stamp(repo, out)
            self.assertIn('version_string = "1.2.3"', text)
            self.assertIn(f'git_hash = "{first}"', text)
            before = out.stat().st_mtime_ns
            time.sleep(0.05)
            self.assertEqual(stamp(repo, out), text)
            self.assertEqual(out.stat().st_mtime_ns, before, "rewritten although the commit is the same")
            git(repo, "commit", "-q", "--allow-empty", "-m", "two")
            second = git(repo, "rev-parse", "--short=12", "HEAD")
            self.assertNotEqual(first, second)
            self.assertIn(f'git_hash = "{second}"', stamp(repo, out))

    def test_outside_a_checkout_the_commit_is_unknown(self):
        with tempfile.TemporaryDirectory() as d:
            source = pathlib.Path(d, "plain")
            source.mkdir()
            environment_dir = os.environ.get("GIT_CEILING_DIRECTORIES")
            os.environ["GIT_CEILING_DIRECTORIES"] = d
            try:
                text = stamp(source, pathlib.Path(d, "version.hpp"))
            finally:
                if environment_dir is None:
                    del os.environ["GIT_CEILING_DIRECTORIES"]
                else:
                    os.environ["GIT_CEILING_DIRECTORIES"] = environment_dir
            self.assertIn('git_hash = "unknown"', text)


if __name__ == "__main__":
    unittest.main()
