//! include/pwfs.h is what cbindgen makes of src/lib.rs with cbindgen.toml. With
//! PWFS_BLESS=1 (scripts/capi-header) the test writes it instead of comparing.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut made = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen cannot read src/lib.rs")
        .write(&mut made);
    let path = dir.join("include/pwfs.h");
    if std::env::var_os("PWFS_BLESS").is_some() {
        std::fs::write(&path, &made).expect("write include/pwfs.h");
        return;
    }
    let have = std::fs::read(&path).unwrap_or_default();
    assert!(
        have == made,
        "include/pwfs.h is not what cbindgen makes of src/lib.rs: run scripts/capi-header and commit it\n\
         --- generated ---\n{}",
        String::from_utf8_lossy(&made)
    );
}
