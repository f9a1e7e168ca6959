//! Asking a reconciler about an in-doubt operation before it is sent again.

use std::sync::Arc;

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower_service::Service;

use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::{Decision, Track, WireKey};
use crate::idempotency::engine::LeaseGuard;
use crate::idempotency::reconcile::{self, InDoubtOperation, Reconciled};
use crate::ledger::{IdempotencyStore, LeaseToken, LedgerKey};
use crate::FrozenRequest;
use crate::ResponseSource;
use crate::{BoxError, Error};

use super::exchange::exchange;
use super::face::ClientFace;
use super::send::Sending;
/// Ask the reconciler about an in-doubt operation we now own under `token`, and act on its
/// answer: record and return what it found, send the frozen bytes it says never arrived,
/// or leave the operation in doubt.
pub(super) async fn reconcile<S, ResBody, M>(
    inner: S,
    client: &Arc<ClientFace>,
    (key, track): (LedgerKey, &Track),
    token: LeaseToken,
    original: FrozenRequest,
    extensions: Extensions,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    M: Sending<S, ResBody>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let reconciler = client
        .reconciler
        .as_deref()
        .expect("only called with a reconciler");
    // Dropped before settling (the caller gave up), the guard leaves the operation in doubt.
    let lease = client.ledger.hold(key, token);
    let attempts = match client.ledger.store.inspect(key).await {
        Ok(view) => view.map(|view| view.attempts),
        Err(_) => None,
    };
    let wire_key = match track.wire() {
        Some(WireKey::Derived(key)) => key.to_hex(),
        Some(WireKey::Header(key)) => key.as_str().to_owned(),
        None => String::new(),
    };
    let operation = InDoubtOperation::new(original.clone(), wire_key, attempts)
        .with_key_header(client.key_header.clone());
    let verdict = lease
        .renewing(
            track,
            reconcile::ask(reconciler, operation, client.reconcile_timeout),
        )
        .await;
    match verdict {
        Ok(Reconciled::Applied(found)) => {
            track.decided(Decision::Reconciled);
            tracing::info!(key = %key.to_hex(), status = %found.status(), "in-doubt operation reconciled: it happened");
            record_reconciled(client, lease, found).await
        }
        Ok(Reconciled::NotApplied) => {
            tracing::info!(key = %key.to_hex(), "in-doubt operation reconciled: it never happened; sending the frozen request");
            track.decided(Decision::Resumed);
            let token = lease.hand_on();
            exchange::<S, ResBody, M>(
                inner,
                client,
                (key, track),
                token,
                &original,
                extensions,
                ResponseSource::Resent,
            )
            .await
        }
        unknown => {
            track.decided(Decision::InDoubt);
            if let Err(err) = lease.mark_in_doubt().await {
                tracing::warn!(%err, "could not leave the operation in doubt; its lease will expire into doubt");
            }
            // `Reconciled` may grow: whatever else it says is not an answer either way.
            Err(Error::unreconciled(unknown.err()))
        }
    }
}

/// Record what the reconciler found as the operation's outcome (a tombstone if it is over
/// the recording cap) and return it.
async fn record_reconciled<T>(
    client: &ClientFace,
    lease: LeaseGuard,
    found: Response<Bytes>,
) -> Result<Response<ResponseBody<T>>, Error> {
    let (parts, body) = found.into_parts();
    let outcome = reconcile::recorded_outcome(
        parts.status,
        parts.version,
        &parts.headers,
        &body,
        client.response_limit,
    );
    if let Err(err) = lease.complete(outcome).await {
        // Fenced (the operation was taken over) or the store is away: the caller still
        // gets what happened; a later run finds it in doubt and reconciles again.
        tracing::error!(%err, "could not record the reconciled outcome");
    }
    let mut response = Response::from_parts(parts, ResponseBody::buffered(body));
    response.extensions_mut().insert(ResponseSource::Reconciled);
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::HeaderBlock;

    #[test]
    fn a_detached_copy_owns_its_bytes_and_keeps_every_header_as_it_was() {
        let read_buffer = Bytes::from(b"text/plain;ch_1secret{\"id\":\"ch_1\"}".to_vec());
        let start = read_buffer.as_ptr() as usize;
        let range = start..start + read_buffer.len();
        let value = |at: std::ops::Range<usize>| {
            http::HeaderValue::from_maybe_shared(read_buffer.slice(at)).unwrap()
        };
        let mut headers = http::HeaderMap::new();
        headers.append(http::header::CONTENT_TYPE, value(0..10));
        headers.append("x-charge-id", value(11..15));
        headers.append("x-charge-id", http::HeaderValue::from_static(""));
        let mut secret = value(15..21);
        secret.set_sensitive(true);
        headers.append(http::header::AUTHORIZATION, secret);
        let body = read_buffer.slice(21..);

        let recorded = HeaderBlock::with_body(&headers, &body);
        let copied_body = recorded.body();
        let copy = recorded.to_map();

        assert_eq!(copied_body, body);
        assert!(!range.contains(&(copied_body.as_ptr() as usize)));
        let before: Vec<_> = headers.iter().collect();
        let after: Vec<_> = copy.iter().collect();
        assert_eq!(before, after, "the same headers, in the same order");
        for ((_, was), (_, is)) in headers.iter().zip(copy.iter()) {
            assert_eq!(was.is_sensitive(), is.is_sensitive());
            assert!(is.is_empty() || !range.contains(&(is.as_bytes().as_ptr() as usize)));
        }
    }

    #[test]
    fn a_records_headers_and_body_share_one_buffer() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        headers.append("x-charge-id", http::HeaderValue::from_static("ch_1"));
        let block = HeaderBlock::with_body(&headers, b"{\"id\":\"ch_1\"}");
        let body = block.body();
        // The body starts where the block's last value ends: one allocation, freed once.
        let last = block.entries().last().expect("two entries");
        let end = block.value_bytes(&last).as_ptr_range().end;
        assert_eq!(end, body.as_ptr());
    }
}
