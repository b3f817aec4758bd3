//! Runs against the libsteptrace the steptrace crate linked (DEP_STEPTRACE_LIB_DIR, from
//! its build script): an rpath, so no LD_LIBRARY_PATH is needed for a library outside
//! the linker's default directories (a build tree's client/). An installed library in a
//! system directory needs nothing; then the variable is empty.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_STEPTRACE_LIB_DIR");
    if let Some(dirs) = std::env::var_os("DEP_STEPTRACE_LIB_DIR") {
        for dir in dirs.to_string_lossy().split(':').filter(|d| !d.is_empty()) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
