//! A TCP proxy of the test's own in front of a redis-server: the network between a worker and
//! Redis, which a fault test or the chaos run cuts off (as a partition would) or routes to
//! another server (as a failover would).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A TCP proxy on a port of its own. Cut off, it drops every connection through it and accepts
/// new ones without ever answering them, as behind a network partition; routed again, to the
/// same server or another, it drops every connection (those held while cut off too), so each
/// client reconnects to the server it now points at.
pub struct Proxy {
    /// The port clients connect to.
    pub port: u16,
    route: Arc<Mutex<Route>>,
    accept: JoinHandle<()>,
}

#[derive(Default)]
struct Route {
    /// The port of the redis-server new connections go to; `None` while cut off.
    target: Option<u16>,
    /// The connections being forwarded, one task each: aborting a task drops both its sockets.
    links: Vec<JoinHandle<()>>,
    /// The connections accepted while cut off, held unanswered.
    held: Vec<TcpStream>,
}

impl Route {
    fn drop_all(&mut self) {
        for link in self.links.drain(..) {
            link.abort();
        }
        self.held.clear();
    }
}

impl Proxy {
    /// Starts forwarding to the server on 127.0.0.1:`target`.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("the proxy's address").port();
        let route = Arc::new(Mutex::new(Route {
            target: Some(target),
            ..Route::default()
        }));
        let accepting = route.clone();
        let accept = tokio::spawn(async move {
            loop {
                let client = match listener.accept().await {
                    Ok((client, _)) => client,
                    Err(_) => {
                        // Out of file descriptors, say: try again shortly rather than spin.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let mut route = lock(&accepting);
                route.links.retain(|link| !link.is_finished());
                match route.target {
                    None => route.held.push(client),
                    Some(target) => route.links.push(tokio::spawn(forward(client, target))),
                }
            }
        });
        Self {
            port,
            route,
            accept,
        }
    }

    /// The Redis URL of the proxy (database 0).
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// Drops every connection through the proxy; new ones are held unanswered until
    /// [`Proxy::route_to`].
    pub fn cut(&self) {
        let mut route = lock(&self.route);
        route.target = None;
        route.drop_all();
    }

    /// Drops every connection through the proxy (those held while cut off too), and forwards
    /// new ones to the server on 127.0.0.1:`target`.
    pub fn route_to(&self, target: u16) {
        let mut route = lock(&self.route);
        route.target = Some(target);
        route.drop_all();
    }

    /// Whether the proxy is cut off.
    pub fn is_cut(&self) -> bool {
        lock(&self.route).target.is_none()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        lock(&self.route).drop_all();
    }
}

fn lock(route: &Mutex<Route>) -> std::sync::MutexGuard<'_, Route> {
    // The route is a plain value, consistent after every statement: a panic elsewhere while it
    // was held leaves nothing half-done.
    route.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn forward(mut client: TcpStream, target: u16) {
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}
