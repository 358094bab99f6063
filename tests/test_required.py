"""tests/helpers/required.py: a missing optional package skips its tests, or fails them under its flag."""

import pytest

from tests.helpers.required import located, require


def test_a_missing_package_skips_and_fails_under_its_flag(monkeypatch):
    monkeypatch.delenv("LFA_REQUIRE_NOTHING", raising=False)
    assert located("no_such_package_here", "LFA_REQUIRE_NOTHING", "nothing") is None
    with pytest.raises(pytest.skip.Exception, match="no_such_package_here is not installed"):
        require("no_such_package_here", "LFA_REQUIRE_NOTHING", "nothing")
    monkeypatch.setenv("LFA_REQUIRE_NOTHING", "1")
    with pytest.raises(pytest.fail.Exception, match=r"no_such_package_here.sub is not installed, and LFA_REQUIRE_NOTHING=1"):
        located("no_such_package_here.sub", "LFA_REQUIRE_NOTHING", "nothing")


def test_an_installed_package_gives_its_directory():
    assert located("json", "LFA_REQUIRE_NOTHING", "nothing").endswith("json")
    assert require("pytest", "LFA_REQUIRE_NOTHING", "nothing")
