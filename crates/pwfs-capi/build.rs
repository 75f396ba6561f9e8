//! The shared object names itself libpwfs.so (DT_SONAME), so that programs linked with
//! -lpwfs record that name whatever file they were linked against.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libpwfs.so");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
