#![allow(dead_code)]
//! Helpers shared by the tests that go through the kernel. They need root and
//! /dev/fuse (CI has both); elsewhere a test says so and does nothing.

use pwfs::Fs;

pub fn can_mount() -> bool {
    let can = pwfs_fuse::can_mount();
    if !can {
        assert!(
            std::env::var_os("PWFS_REQUIRE_FUSE").is_none(),
            "PWFS_REQUIRE_FUSE: FUSE tests need root and /dev/fuse"
        );
        eprintln!("skipping: FUSE tests need root and /dev/fuse");
    }
    can
}

/// Mount `fs` through the kernel with `options` on a fresh directory named after `name`.
pub fn mount_in(fs: &Fs, name: &str, options: &pwfs_fuse::MountOptions) -> (std::path::PathBuf, pwfs_fuse::Mounted) {
    let dir = std::env::temp_dir().join(format!("pwfs-fuse-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mounted = pwfs_fuse::mount_with(fs.clone(), &dir, options).unwrap();
    (dir, mounted)
}

/// The errno of a call expected to fail.
pub fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("expected an error").raw_os_error().expect("an OS error")
}
