//! Finds libsteptrace and links it dynamically:
//!   1. $STEPTRACE_LIB_DIR, the directory holding libsteptrace.so (e.g. a build tree's
//!      client/ directory);
//!   2. else `pkg-config --libs-only-L steptrace` ($PKG_CONFIG, default pkg-config), i.e.
//!      an installed steptrace (steptrace.pc);
//!   3. else the build fails and says how to fix it.
//!
//! The directories found get an rpath in this package's own tests and examples, and are
//! passed on to packages that depend on this one as DEP_STEPTRACE_LIB_DIR (':'-separated).

use std::env;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{self, Command};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["STEPTRACE_LIB_DIR", "PKG_CONFIG", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let dirs = match env::var_os("STEPTRACE_LIB_DIR") {
        Some(dir) if !dir.is_empty() => from_env(PathBuf::from(dir)),
        _ => from_pkg_config(),
    };

    for dir in &dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
        // Only this package's test, example and bench binaries (not dependents).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    println!("cargo:rustc-link-lib=dylib=steptrace");
    let joined: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    println!("cargo:lib_dir={}", joined.join(":"));
}

fn fail(message: &str) -> ! {
    eprintln!("error: steptrace: {message}");
    eprintln!(
        "error: steptrace: set STEPTRACE_LIB_DIR to the directory holding libsteptrace.so \
         (in a build tree: BUILD/client), or install steptrace so that \
         `pkg-config --libs-only-L steptrace` finds it (see PKG_CONFIG_PATH)"
    );
    process::exit(1);
}

fn from_env(dir: PathBuf) -> Vec<PathBuf> {
    if !dir.join("libsteptrace.so").exists() {
        fail(&format!("STEPTRACE_LIB_DIR={} has no libsteptrace.so", dir.display()));
    }
    vec![dir]
}

fn from_pkg_config() -> Vec<PathBuf> {
    let program = env::var_os("PKG_CONFIG")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| OsString::from("pkg-config"));
    let output = match Command::new(&program).args(["--libs-only-L", "steptrace"]).output() {
        Ok(output) => output,
        Err(e) => fail(&format!(
            "STEPTRACE_LIB_DIR is not set and {} could not be run ({e})",
            program.to_string_lossy()
        )),
    };
    if !output.status.success() {
        fail(&format!(
            "STEPTRACE_LIB_DIR is not set and `{} --libs-only-L steptrace` failed ({}): {}",
            program.to_string_lossy(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    // Empty when the library is in a directory the linker searches anyway (pkg-config
    // leaves out the system's).
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .filter_map(|flag| flag.strip_prefix("-L"))
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .collect()
}
