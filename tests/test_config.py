"""The one typed config object: unknown keys and bad values raise and name what is valid."""

import pytest

import kiln
from kiln.config import ConfigError, from_env


def test_unknown_key_names_valid_keys():
    with pytest.raises(ConfigError) as e:
        kiln.config.update(cheks=True)
    assert "unknown Kiln config key 'cheks'" in str(e.value)
    assert "checks" in str(e.value) and "cache_dir" in str(e.value)


def test_unknown_env_variable_names_valid_ones():
    with pytest.raises(ConfigError) as e:
        from_env({"KILN_EAGRE": "1"})
    assert "unknown environment variable KILN_EAGRE" in str(e.value)
    assert "KILN_EAGER" in str(e.value)


def test_bad_env_value():
    with pytest.raises(ConfigError, match=r"KILN_EAGER='maybe' is not a boolean; use 1 or 0"):
        from_env({"KILN_EAGER": "maybe"})
    with pytest.raises(ConfigError, match="config 'backend' must be one of cpp, interpreter"):
        from_env({"KILN_BACKEND": "tpu"})
    with pytest.raises(ConfigError, match="KILN_LOG part 'everything' is unknown"):
        from_env({"KILN_LOG": "graphs,everything"})


def test_good_env_values():
    c = from_env({"KILN_CHECKS": "1", "KILN_BACKEND": "interpreter", "KILN_RECOMPILE_WARN": "9"})
    assert c.checks is True and c.backend == "interpreter" and c.recompile_warn == 9


def test_type_checked_update():
    with pytest.raises(ConfigError, match="config 'checks' must be True or False"):
        kiln.config.update(checks="yes")


def test_check_validates_without_changing_anything():
    before = kiln.config.checks
    assert kiln.config.check(checks=not before) == {"checks": not before}
    assert kiln.config.checks is before
    with pytest.raises(ConfigError, match="config 'checks' must be True or False"):
        kiln.config.check(checks="yes")
    with pytest.raises(ConfigError, match="unknown Kiln config key 'chekcs'"):
        kiln.config.check(chekcs=True)


def test_backend_choices_come_from_the_backend_registry():
    from kiln.codegen import Backend, get_backend, register_backend
    from kiln.codegen.base import unregister_backend
    from kiln.codegen.interpreter import build

    with pytest.raises(ConfigError, match="'backend' must be one of cpp, interpreter; got 'tiny'"):
        kiln.config.update(backend="tiny")
    register_backend(Backend("tiny", build))
    saved = kiln.config.backend
    try:
        kiln.config.update(backend="tiny")  # a registered backend is a valid value at once
        assert from_env({"KILN_BACKEND": "tiny"}).backend == "tiny"
    finally:
        kiln.config.update(backend=saved)
        unregister_backend("tiny")
    with pytest.raises(ConfigError, match="no Kiln backend named 'tiny'; registered: cpp, interp"):
        get_backend("tiny")  # e.g. KILN_BACKEND read before the registry was
