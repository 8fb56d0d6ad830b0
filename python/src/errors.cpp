// See errors.hpp.
#include "errors.hpp"

#include "strata/error.hpp"

namespace py = pybind11;

namespace strata::python {
namespace {

// Sets the Python error for `e` (the GIL is held: pybind11 runs translators with it).
void raise_python(const Error& e) {
  py::dict attrs;
  if (const auto* c = dynamic_cast<const ConfigError*>(&e)) {
    attrs["file"] = c->file();
    attrs["line"] = c->line();
    attrs["column"] = c->column();
    attrs["key_path"] = c->key_path();
    attrs["detail"] = c->detail();
  } else if (const auto* io = dynamic_cast<const IoError*>(&e)) {
    attrs["op"] = io->op();
    attrs["path"] = io->path();
    attrs["offset"] = io->offset();
    attrs["length"] = io->length();
    attrs["errno"] = io->errnum();
    attrs["context"] = io->context();
  }
  py::object exc = py::module_::import("strata.errors")
                       .attr("_from_strata")(error_code_name(e.code()), e.what(), attrs);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

}  // namespace

void register_error_translator() {
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      try {
        raise_python(e);
      } catch (py::error_already_set& inner) {  // strata.errors itself failed: keep its error
        inner.restore();
      }
    }
  });
}

}  // namespace strata::python
