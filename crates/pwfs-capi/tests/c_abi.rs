//! The C ABI from C: tests/c/smoke.c compiled with `cc` against include/pwfs.h, linked
//! once with libpwfs.a and once with libpwfs.so, and run on an image in a scratch
//! directory. Skipped (with a message) when there is no `cc`.
//!
//! `cargo test` does not build a package's cdylib and staticlib for its own tests (it
//! builds them only with `cargo build`), so this test runs `cargo build -p pwfs-capi`
//! in the profile and target directory it was built in (both read off the path of
//! its executable, `<target>/<profile dir>/deps/c_abi-*`) first: the libraries it
//! links are always those of the source under test.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What a program linked with libpwfs.a needs besides it (rustc's
/// `--print native-static-libs` for this target).
const NATIVE_LIBS: &[&str] = &["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"];

fn have_cc() -> bool {
    Command::new("cc").arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

/// The target directory and the profile directory this test was built into.
fn build_dirs() -> (PathBuf, PathBuf) {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("<target>/<profile>/deps/<test>").to_path_buf();
    let target = profile_dir.parent().expect("<target>/<profile>").to_path_buf();
    (target, profile_dir)
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let dir = std::env::temp_dir().join(format!("pwfs-capi-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn smoke_c_program_static_and_shared() {
    if !have_cc() {
        eprintln!("skipping the C ABI smoke test: no cc");
        return;
    }
    let (target, profile_dir) = build_dirs();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()).expect("profile dir") {
        "debug" => "dev".to_string(),
        other => other.to_string(),
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(Command::new(cargo)
        .args(["build", "-p", "pwfs-capi", "--lib", "--profile", &profile, "--target-dir"])
        .arg(&target)
        .current_dir(manifest));
    let (a, so) = (profile_dir.join("libpwfs.a"), profile_dir.join("libpwfs.so"));
    assert!(a.exists() && so.exists(), "no {} or {}", a.display(), so.display());

    let scratch = Scratch::new("smoke");
    let source = manifest.join("tests/c/smoke.c");
    let include = manifest.join("include");
    let cc = |out: &Path| {
        let mut c = Command::new("cc");
        c.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"]).arg(out).arg(&source).arg("-I").arg(&include);
        c
    };
    let static_exe = scratch.0.join("smoke-static");
    run(cc(&static_exe).arg(&a).args(NATIVE_LIBS));
    let shared_exe = scratch.0.join("smoke-shared");
    run(cc(&shared_exe)
        .arg("-L")
        .arg(&profile_dir)
        .arg(format!("-Wl,-rpath,{}", profile_dir.display()))
        .arg("-lpwfs")
        .arg("-lpthread"));

    for exe in [&static_exe, &shared_exe] {
        let work = scratch.0.join(format!("{}-run", exe.file_name().unwrap().to_string_lossy()));
        std::fs::create_dir_all(&work).unwrap();
        let out = Command::new(exe).arg(&work).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{} failed ({}):\n{stdout}\n{}",
            exe.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("checks passed"), "{stdout}");
        eprintln!("{}: {}", exe.file_name().unwrap().to_string_lossy(), stdout.trim());
    }
    check_exports(&so);
}

/// The shared object is named libpwfs.so inside too (DT_SONAME), and exports the ABI
/// and nothing else: no symbol of Rust's or the engine's. Skipped without binutils.
fn check_exports(so: &Path) {
    let (Ok(nm), Ok(readelf)) = (
        Command::new("nm").args(["-D", "--defined-only"]).arg(so).output(),
        Command::new("readelf").arg("-d").arg(so).output(),
    ) else {
        eprintln!("skipping the symbol check: no nm or readelf");
        return;
    };
    let dynamic = String::from_utf8_lossy(&readelf.stdout);
    assert!(dynamic.contains("Library soname: [libpwfs.so]"), "{dynamic}");
    let syms = String::from_utf8_lossy(&nm.stdout);
    let exported: Vec<&str> = syms.lines().filter_map(|l| l.split_whitespace().nth(2)).collect();
    for want in ["pwfs_mkfs", "pwfs_mount", "pwfs_unmount", "pwfs_open", "pwfs_pwrite", "pwfs_readdir"] {
        assert!(exported.contains(&want), "{want} not exported by {}", so.display());
    }
    let header = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/pwfs.h")).unwrap();
    for sym in &exported {
        assert!(sym.starts_with("pwfs_"), "{} exports {sym}, not part of the ABI", so.display());
        assert!(header.contains(&format!(" {sym}(")) || header.contains(&format!("*{sym}(")), "{sym} is not in pwfs.h");
    }
}
