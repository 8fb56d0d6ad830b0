// Rethrowing an error captured on another thread (a stream worker, a mover thread) as a fresh
// exception object owned by the calling thread. std::rethrow_exception would throw the shared
// object itself, whose copy-on-write message string is then released by the other thread without
// a happens-before edge visible to ThreadSanitizer (libstdc++'s refcounts are not instrumented).
// The copy keeps the type (IoError, ConfigError are rebuilt from their fields; every other
// strata::Error keeps its code and message).
#pragma once

#include <exception>

namespace strata {

[[noreturn]] void rethrow_detached(const std::exception_ptr& error);

}  // namespace strata
