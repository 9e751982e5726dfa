"""Shared defaults of every run config: the schema of span_lm/config.py (`base_config`).

Every run config starts from `get_base_config()` and changes what differs. The fields, their
defaults and their meanings are written once, in the package: config.model is
span_lm.model.config.ModelConfig's fields, the other sections are span_lm/config.py's.
"""
import ml_collections

from span_lm import config as config_lib


def get_base_config() -> ml_collections.ConfigDict:
  return config_lib.base_config()
