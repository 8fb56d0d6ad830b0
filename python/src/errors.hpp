// strata::Error -> Python exceptions (python/strata/errors.py): the class follows the ErrorCode,
// the message is strata's what(), ConfigError / IoError carry their fields as attributes.
#pragma once

#include <pybind11/pybind11.h>

namespace strata::python {

// Registers the translator with pybind11 for every binding of this module. Call once, at import.
void register_error_translator();

}  // namespace strata::python
