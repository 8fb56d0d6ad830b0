#include "core/rethrow.hpp"

#include <string>

#include "strata/error.hpp"

namespace strata {

void rethrow_detached(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    // what() = "<prefix>[: context]"; rebuild the context from the part after the prefix.
    const std::string prefix = IoError(e.op(), e.path(), e.offset(), e.length(), e.errnum()).what();
    const std::string full(e.what(), std::char_traits<char>::length(e.what()));
    std::string context;
    if (full.size() > prefix.size() + 2 && full.compare(0, prefix.size(), prefix) == 0) {
      context = full.substr(prefix.size() + 2);
    }
    throw IoError(std::string(e.op()), std::string(e.path()), e.offset(), e.length(), e.errnum(),
                  context);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.file()), e.line(), e.column(), std::string(e.key_path()),
                      std::string(e.detail()));
  } catch (const Error& e) {
    throw Error(e.code(), std::string(e.what(), std::char_traits<char>::length(e.what())));
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kInternal, std::string(e.what()));
  }
}

}  // namespace strata
