"""The model zoo. Importing any part of it registers every component in its registry: the modules
`config.catalogue` names, so a new component is its file and its catalogue line."""

import importlib

from config.catalogue import modules

for _module in modules():
    importlib.import_module(f"arch.{_module}")
