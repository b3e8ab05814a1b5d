//! S3 over HTTPS gets as far as the TLS handshake. The HTTP client is built
//! without a TLS provider of its own (`core/Cargo.toml`: ring, not aws-lc-rs),
//! so opening an S3 store installs ring's; were it missing, building the client
//! would panic. One test in its own binary: it sets the process's environment.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use ckpt_core::store::{s3, S3Options};
use object_store::path::Path;
use object_store::ObjectStoreExt;

#[tokio::test]
async fn https_endpoint_speaks_tls_and_fails_typed() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // A server that answers in plain HTTP: the client's first bytes show what
    // it spoke, and its handshake then fails.
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut first = [0u8; 5];
        conn.read_exact(&mut first).unwrap();
        let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        first
    });
    for (k, v) in [
        ("AWS_ENDPOINT", format!("https://127.0.0.1:{port}")),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("AWS_REGION", "test".into()),
    ] {
        // SAFETY: the only test of this binary, before any other thread reads it.
        unsafe { std::env::set_var(k, v) };
    }
    let mut opts = S3Options::new("bucket", "prefix");
    opts.max_retries = 0;
    opts.connect_timeout = Duration::from_secs(5);
    opts.request_timeout = Duration::from_secs(5);
    let store = s3::open(&opts).expect("an S3 store over HTTPS builds");
    let put = store.put(&Path::from("k"), "v".into()).await;
    assert!(
        put.is_err(),
        "a plain-HTTP server cannot complete a TLS request"
    );
    let first = server.join().unwrap();
    // A TLS record of type handshake (22), version 3.x: a ClientHello.
    assert_eq!((first[0], first[1]), (0x16, 0x03), "client sent {first:?}");
}
