//! Permission rules through the kernel (issue 11): set-id bits cleared by an
//! unprivileged writer in every kernel cache mode, set-group-ID directories, POSIX
//! ACLs enforced by the kernel and inherited. Needs root and /dev/fuse; the ACL test
//! also `setfacl`/`getfacl` (Debian package `acl`), and says so when they are missing.

mod common;
use common::{can_mount, mount_in};
use pwfs::device::mem::MemDevice;
use pwfs::{Config, Fs, MkfsOptions};
use pwfs_fuse::{KernelCache, MountOptions};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

const NOBODY: u32 = 65534;

fn fresh_fs() -> Fs {
    let dev = Arc::new(MemDevice::new(64 << 20));
    pwfs::mkfs(&*dev, &MkfsOptions::default()).unwrap();
    Fs::mount(dev, Config { cache_bytes: 8 << 20, ..Default::default() }).unwrap()
}

/// Run a shell command as nobody (no supplementary groups, no capabilities): whether
/// it succeeded, and what it printed on stderr.
fn as_nobody(script: &str) -> (bool, String) {
    let out = Command::new("/bin/sh").arg("-c").arg(script).uid(NOBODY).gid(NOBODY).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn sh(script: &str) -> String {
    let out = Command::new("/bin/sh").arg("-c").arg(script).output().unwrap();
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().mode() & 0o7777
}

fn set_caps(p: &Path, value: &[u8]) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid C strings and buffer.
    let r = unsafe {
        libc::setxattr(c.as_ptr(), c"security.capability".as_ptr(), value.as_ptr() as *const _, value.len(), 0)
    };
    assert_eq!(r, 0, "setxattr security.capability: {}", std::io::Error::last_os_error());
}

fn has_caps(p: &Path) -> bool {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: valid C strings and buffer.
    let r =
        unsafe { libc::getxattr(c.as_ptr(), c"security.capability".as_ptr(), buf.as_mut_ptr() as *mut _, buf.len()) };
    r > 0
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn unprivileged_writes_and_truncates_clear_set_id_bits_in_every_cache_mode() {
    if !can_mount() {
        return;
    }
    for cache in [KernelCache::Off, KernelCache::WriteThrough, KernelCache::WriteBack] {
        let fs = fresh_fs();
        let o = MountOptions { allow_other: true, kernel_cache: cache, ..Default::default() };
        let (dir, mounted) = mount_in(&fs, &format!("setid-{cache:?}"), &o);
        let p = |s: &str| dir.join(s);
        // (initial mode, how it is changed, mode after) — ext4's answers.
        // (ext4 on Linux 6.18 gives each of these answers.)
        let cases: [(&str, u32, &str, u32); 13] = [
            ("suid", 0o4777, "append", 0o777),
            ("falloc", 0o6777, "fallocate", 0o777),
            ("copy", 0o6777, "copy_file_range", 0o777),
            ("sgid", 0o2777, "append", 0o777),
            // S_ISGID without group execute marks mandatory locking: kept by a writer
            // in the file's group ("member" belongs to nobody's), cleared by another.
            ("lock", 0o2767, "append", 0o767),
            ("member", 0o2767, "append", 0o2767),
            ("both", 0o6777, "pwrite", 0o777),
            ("trunc", 0o6777, "truncate", 0o777),
            ("root", 0o6777, "root-append", 0o6777),
            // Root holds CAP_FSETID (read from /proc: the kernel leaves it to us).
            ("root-trunc", 0o6777, "root-truncate", 0o6777),
            ("chown", 0o6777, "chown", 0o777),
            // chown(f, -1, -1) by root: S_ISUID goes, S_ISGID as by a member.
            ("same-owner", 0o6767, "chown-same", 0o2767),
            ("same-owner-x", 0o6777, "chown-same", 0o777),
        ];
        for (name, before, how, after) in cases {
            let f = p(name);
            std::fs::write(&f, b"data").unwrap();
            if name == "member" {
                std::os::unix::fs::chown(&f, None, Some(NOBODY)).unwrap();
            }
            chmod(&f, before);
            let changed_at = |f: &Path| {
                let m = std::fs::metadata(f).unwrap();
                (m.ctime(), m.ctime_nsec())
            };
            let ctime = changed_at(&f);
            let engine_ctime = || {
                let t = fs.metadata(format!("/{name}")).unwrap().ctime;
                (t.sec, t.nsec)
            };
            let engine_before = engine_ctime();
            assert_eq!(mode(&f), before);
            let path = f.display();
            match how {
                "append" => assert!(as_nobody(&format!("echo x >> {path}")).0),
                "pwrite" => {
                    assert!(as_nobody(&format!("printf y | dd of={path} bs=1 seek=2 conv=notrunc 2>/dev/null")).0)
                }
                "truncate" => assert!(as_nobody(&format!("truncate -s 1 {path}")).0),
                "fallocate" => {
                    let r = as_nobody(&format!("fallocate -l 8192 {path}"));
                    assert!(r.0, "fallocate: {}", r.1);
                }
                "copy_file_range" => {
                    let src = p("copy-src");
                    std::fs::write(&src, b"from").unwrap();
                    chmod(&src, 0o644);
                    let py = format!(
                        "import os; a=os.open('{}', os.O_RDONLY); b=os.open('{path}', os.O_WRONLY); \
                         assert os.copy_file_range(a, b, 4) == 4",
                        src.display()
                    );
                    let r = as_nobody(&format!("python3 -c \"{py}\""));
                    assert!(r.0, "copy_file_range: {}", r.1);
                }
                "root-append" => {
                    sh(&format!("echo x >> {path}"));
                }
                "root-truncate" => {
                    sh(&format!("truncate -s 1 {path}"));
                }
                "chown" => std::os::unix::fs::chown(&f, Some(1), Some(1)).unwrap(),
                "chown-same" => {
                    // Past the kernel's clock tick (its times are coarse).
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    std::os::unix::fs::chown(&f, None, None).unwrap();
                    // (With the kernel's write-back cache the kernel keeps a file's
                    // times itself and shows its own.)
                    if cache != KernelCache::WriteBack {
                        assert_ne!(changed_at(&f), ctime, "{name}: chown(-1, -1) left ctime, kernel cache {cache:?}");
                    }
                    assert_ne!(engine_ctime(), engine_before, "{name}: chown(-1, -1) left ctime in the engine");
                }
                _ => unreachable!(),
            }
            assert_eq!(mode(&f), after, "{name} ({how}) with kernel cache {cache:?}: {:o}", mode(&f));
        }
        // File capabilities go at any write or truncate, root's included (a
        // capability set of revision 2: cap_net_bind_service permitted).
        let caps: [u8; 20] = [0, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        for (name, how) in [("cap-append", "append"), ("cap-trunc", "truncate"), ("cap-root", "root-append")] {
            let f = p(name);
            std::fs::write(&f, b"data").unwrap();
            chmod(&f, 0o777);
            set_caps(&f, &caps);
            assert!(has_caps(&f), "{name}: set");
            let path = f.display();
            match how {
                "append" => assert!(as_nobody(&format!("echo x >> {path}")).0),
                "truncate" => assert!(as_nobody(&format!("truncate -s 1 {path}")).0),
                "root-append" => drop(sh(&format!("echo x >> {path}"))),
                _ => unreachable!(),
            }
            assert!(!has_caps(&f), "{name} ({how}) with kernel cache {cache:?}: capabilities kept");
            // A second write, after the kernel knows the file has none, keeps it so.
            set_caps(&f, &caps);
            sh(&format!("echo y >> {path}"));
            assert!(!has_caps(&f), "{name}: capabilities set again survived a write, kernel cache {cache:?}");
        }
        // An append-only file: an append drops its capabilities and succeeds, as on
        // ext4; an immutable one keeps them (the write fails).
        let f = p("cap-append-only");
        std::fs::write(&f, b"data").unwrap();
        set_caps(&f, &caps);
        sh(&format!("chattr +a {}", f.display()));
        sh(&format!("echo x >> {}", f.display()));
        assert!(!has_caps(&f), "append-only, kernel cache {cache:?}: capabilities kept");
        sh(&format!("chattr -a {}", f.display()));
        let f = p("cap-immutable");
        std::fs::write(&f, b"data").unwrap();
        chmod(&f, 0o4777);
        set_caps(&f, &caps);
        sh(&format!("chattr +i {}", f.display()));
        assert!(!as_nobody(&format!("echo x >> {}", f.display())).0);
        assert!(has_caps(&f) && mode(&f) == 0o4777, "immutable, kernel cache {cache:?}: changed");
        sh(&format!("chattr -i {}", f.display()));
        // What the engine holds agrees with what the kernel showed.
        for (name, after) in [("suid", 0o777), ("lock", 0o767), ("member", 0o2767), ("root", 0o6777)] {
            let md = fs.metadata(format!("/{name}")).unwrap();
            assert_eq!(md.mode & 0o7777, after, "{name} in the engine, kernel cache {cache:?}");
        }
        mounted.unmount().unwrap();
        fs.unmount().unwrap();
    }
}

#[test]
fn set_group_id_directories_pass_on_their_group() {
    if !can_mount() {
        return;
    }
    let fs = fresh_fs();
    let (dir, mounted) = mount_in(&fs, "sgid-dir", &MountOptions { allow_other: true, ..Default::default() });
    let d = dir.join("d");
    std::fs::create_dir(&d).unwrap();
    std::os::unix::fs::chown(&d, None, Some(50)).unwrap();
    chmod(&d, 0o2777);
    let (ok, err) = as_nobody(&format!("umask 022; touch {0}/f && mkdir {0}/sub && touch {0}/sub/g", d.display()));
    assert!(ok, "{err}");
    let f = std::fs::metadata(d.join("f")).unwrap();
    assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (NOBODY, 50, 0o644));
    let sub = std::fs::metadata(d.join("sub")).unwrap();
    assert_eq!((sub.gid(), sub.mode() & 0o7777), (50, 0o2755), "a subdirectory is set-group-ID too");
    assert_eq!(std::fs::metadata(d.join("sub/g")).unwrap().gid(), 50);
    // Not in group 50: S_ISGID asked for at creation of a group-executable file is
    // dropped; root keeps it.
    let create = |name: &str| {
        format!(
            "umask 0; perl -MFcntl -e 'sysopen(F, $ARGV[0], O_CREAT|O_WRONLY, 02755) or die $!' {}/{name}",
            d.display()
        )
    };
    let (ok, err) = as_nobody(&create("y"));
    assert!(ok, "{err}");
    assert_eq!(mode(&d.join("y")), 0o755, "created with 02755 by a non-member");
    sh(&create("z"));
    assert_eq!(mode(&d.join("z")), 0o2755, "created with 02755 by root");
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
}

fn have(tool: &str) -> bool {
    let found = Command::new(tool).arg("--version").output().is_ok();
    if !found {
        eprintln!("skipping: {tool} not installed (Debian package acl)");
    }
    found
}

#[test]
fn posix_acls_are_enforced_kept_in_step_with_the_mode_and_inherited() {
    if !can_mount() || !have("setfacl") || !have("getfacl") {
        return;
    }
    let fs = fresh_fs();
    let (dir, mounted) = mount_in(&fs, "acl", &MountOptions { allow_other: true, ..Default::default() });
    let p = |s: &str| dir.join(s).display().to_string();

    // An entry denying nobody what the mode grants everyone.
    std::fs::write(p("f"), b"secret").unwrap();
    chmod(dir.join("f").as_path(), 0o666);
    assert!(as_nobody(&format!("cat {}", p("f"))).0);
    sh(&format!("setfacl -m u:nobody:--- {}", p("f")));
    let (ok, err) = as_nobody(&format!("cat {}", p("f")));
    assert!(!ok && err.contains("Permission denied"), "nobody reads despite the ACL: {err}");
    assert!(sh(&format!("getfacl -cp {}", p("f"))).contains("user:nobody:---"));
    // An entry granting nobody what the mode does not.
    std::fs::write(p("g"), b"shared").unwrap();
    chmod(dir.join("g").as_path(), 0o600);
    assert!(!as_nobody(&format!("cat {}", p("g"))).0);
    sh(&format!("setfacl -m u:nobody:r {}", p("g")));
    assert_eq!(mode(&dir.join("g")), 0o640, "the mask shows as the group bits");
    let (ok, err) = as_nobody(&format!("cat {}", p("g")));
    assert!(ok, "{err}");
    // chmod moves the mask: group bits 0 deny nobody again.
    chmod(dir.join("g").as_path(), 0o600);
    assert!(sh(&format!("getfacl -cp {}", p("g"))).contains("mask::---"));
    assert!(!as_nobody(&format!("cat {}", p("g"))).0);
    // Malformed ACLs are refused.
    let bad = std::ffi::CString::new(p("g")).unwrap();
    let value = [2u8, 0, 0, 0, 1, 0, 7, 0, 255, 255, 255, 255];
    // SAFETY: valid C strings and a buffer of the given length.
    let r = unsafe {
        libc::setxattr(bad.as_ptr(), c"system.posix_acl_access".as_ptr(), value.as_ptr().cast(), value.len(), 0)
    };
    assert_eq!((r, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EINVAL)));

    // Default ACLs: inherited in place of the umask, and enforced on what inherits.
    std::fs::create_dir(p("d")).unwrap();
    chmod(dir.join("d").as_path(), 0o700);
    sh(&format!("setfacl -m u:nobody:rwx,d:u:nobody:rwx {}", p("d")));
    sh(&format!("umask 077; echo made > {0}/new; mkdir {0}/sub", p("d")));
    let acl = sh(&format!("getfacl -cp {}/new", p("d")));
    assert!(acl.contains("user:nobody:rwx"), "{acl}");
    assert_eq!(mode(&dir.join("d/new")), 0o660, "the default ACL masks 0666; the umask does not apply");
    let (ok, err) = as_nobody(&format!("echo more >> {}/new", p("d")));
    assert!(ok, "the inherited entry lets nobody write: {err}");
    let sub = sh(&format!("getfacl -cp {}/sub", p("d")));
    assert!(sub.contains("default:user:nobody:rwx"), "{sub}");
    assert_eq!(mode(&dir.join("d/sub")), 0o770);
    // Without a default ACL the umask applies.
    sh(&format!("umask 027; touch {}", p("plain")));
    assert_eq!(mode(&dir.join("plain")), 0o640);
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
}

/// An access ACL set by the owner while outside the file's group clears set-group-ID
/// (xfstests generic/375), on files and directories; set by the owner inside the
/// group, it keeps it.
#[test]
fn an_acl_set_from_outside_the_group_clears_set_group_id() {
    if !can_mount() || !have("setfacl") {
        return;
    }
    let fs = fresh_fs();
    let (dir, mounted) = mount_in(&fs, "aclsgid", &MountOptions { allow_other: true, ..Default::default() });
    let p = |s: &str| dir.join(s).display().to_string();
    std::fs::write(p("outside"), b"x").unwrap();
    std::fs::write(p("inside"), b"x").unwrap();
    std::fs::create_dir(p("dir")).unwrap();
    // Owned by nobody; the group root (nobody is not in it) or nobody's own.
    for (name, gid) in [("outside", 0), ("inside", NOBODY), ("dir", 0)] {
        std::os::unix::fs::chown(dir.join(name), Some(NOBODY), Some(gid)).unwrap();
        chmod(dir.join(name).as_path(), 0o2755);
        assert_eq!(mode(&dir.join(name)), 0o2755);
        let (ok, err) = as_nobody(&format!("setfacl -m u::rwx,g::rwx,o::rwx {}", p(name)));
        assert!(ok, "{name}: {err}");
    }
    assert_eq!(mode(&dir.join("outside")), 0o777, "set-group-ID cleared");
    assert_eq!(mode(&dir.join("dir")), 0o777, "set-group-ID cleared on a directory");
    assert_eq!(mode(&dir.join("inside")), 0o2777, "a member keeps set-group-ID");
    // Root (CAP_FSETID) keeps it too, in a group root is not in.
    std::os::unix::fs::chown(dir.join("outside"), None, Some(NOBODY)).unwrap();
    chmod(dir.join("outside").as_path(), 0o2755);
    sh(&format!("setfacl -m u::rwx,g::rwx,o::rwx {}", p("outside")));
    assert_eq!(mode(&dir.join("outside")), 0o2777);
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
}

/// trusted.* names are listed to a caller with CAP_SYS_ADMIN only, as ext4 lists them
/// (the kernel leaves the filtering of a FUSE file system's list to it).
#[test]
fn trusted_attributes_are_listed_to_the_privileged_only() {
    if !can_mount() {
        return;
    }
    let fs = fresh_fs();
    let o = MountOptions { allow_other: true, ..Default::default() };
    let (dir, mounted) = mount_in(&fs, "trusted", &o);
    let f = dir.join("f");
    std::fs::write(&f, b"").unwrap();
    let path = f.display();
    sh(&format!(
        "python3 -c \"import os; os.setxattr('{path}', 'trusted.t', b'1'); os.setxattr('{path}', 'user.u', b'1')\""
    ));
    let list = format!("import os; print(' '.join(sorted(os.listxattr('{path}'))))");
    assert_eq!(sh(&format!("python3 -c \"{list}\"")).trim(), "trusted.t user.u", "root sees both");
    let out = Command::new("python3").arg("-c").arg(&list).uid(NOBODY).gid(NOBODY).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "user.u", "nobody sees no trusted.* name");
    mounted.unmount().unwrap();
    fs.unmount().unwrap();
    let _ = std::fs::remove_dir(&dir);
}
