//! The chat page in a real headless Chromium (driven through ChromeDriver): a message typed
//! on the Consumers page appears on the Workers page, as text.

use std::process::Command;
use std::time::Duration;

use crate::support::Stack;
use chat_services::Side;
use fantoccini::{Client, ClientBuilder, Locator};
use testkit::{shared_postgres, wait_until, ChildProcess};

/// ChromeDriver on a free port, ready for sessions.
async fn chromedriver() -> (ChildProcess, String) {
    let port = testkit::http::free_port();
    let mut cmd = Command::new("chromedriver");
    cmd.arg(format!("--port={port}"))
        .arg("--allowed-ips=127.0.0.1");
    let log = testkit::scratch_dir("chromedriver").join("chromedriver.log");
    let child = ChildProcess::spawn("chromedriver", cmd, &log)
        .expect("chromedriver installed (deploy/install-deps.sh)");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_until(Duration::from_secs(20), "chromedriver ready", || async {
        match testkit::http::get(addr, "/status").await {
            Ok((200, body)) if body.contains("\"ready\":true") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    (child, format!("http://127.0.0.1:{port}"))
}

async fn browser(webdriver: &str) -> Client {
    let profile = testkit::scratch_dir("chromium-profile");
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(webdriver)
        .await
        .expect("browser session")
}

/// The text of the page's messages, in order.
async fn messages(page: &Client) -> Vec<String> {
    let mut texts = Vec::new();
    if let Ok(items) = page
        .find_all(Locator::Css("#messages .message .body"))
        .await
    {
        for item in items {
            texts.push(item.text().await.unwrap_or_default());
        }
    }
    texts
}

/// Two tabs on Consumers (on two instances) and one on Workers, all on chat 31.
async fn scenario(
    consumers_page: &Client,
    second_consumers_page: &Client,
    workers_page: &Client,
    [consumers, second_consumers, workers]: [&str; 3],
) {
    consumers_page
        .goto(&format!("{consumers}/#chat=31"))
        .await
        .unwrap();
    second_consumers_page
        .goto(&format!("{second_consumers}/#chat=31"))
        .await
        .unwrap();
    workers_page
        .goto(&format!("{workers}/#chat=31"))
        .await
        .unwrap();
    for page in [consumers_page, second_consumers_page, workers_page] {
        wait_until(Duration::from_secs(20), "page live", || async {
            let status = page
                .find(Locator::Id("status"))
                .await
                .map_err(|e| e.to_string())?;
            let text = status.text().await.map_err(|e| e.to_string())?;
            if text == "live" {
                Ok(())
            } else {
                Err(text)
            }
        })
        .await;
    }
    // Typed on the Consumers page (markup in it must stay text).
    let text = "hello <b>workers</b> from the browser";
    let input = consumers_page.find(Locator::Id("body")).await.unwrap();
    input.send_keys(text).await.unwrap();
    consumers_page
        .find(Locator::Id("send"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(20),
        "message shown on the Consumers page",
        || async {
            let shown = messages(consumers_page).await;
            if shown == [text] {
                Ok(())
            } else {
                Err(format!("{shown:?}"))
            }
        },
    )
    .await;
    // ... appears on the Workers page, live, as received text, and on the other
    // Consumers tab (another instance), live, as sent text.
    for (page, name) in [
        (workers_page, "Workers page"),
        (second_consumers_page, "second Consumers tab"),
    ] {
        wait_until(
            Duration::from_secs(20),
            &format!("message shown on the {name}"),
            || async {
                let shown = messages(page).await;
                if shown == [text] {
                    Ok(())
                } else {
                    Err(format!("{shown:?}"))
                }
            },
        )
        .await;
    }
    assert_eq!(
        second_consumers_page
            .find_all(Locator::Css("#messages .message.sent"))
            .await
            .unwrap()
            .len(),
        1,
        "shown as this side's own message"
    );
    let received = workers_page
        .find(Locator::Css("#messages .message.received"))
        .await
        .unwrap();
    assert_eq!(
        received.find_all(Locator::Css("b")).await.unwrap().len(),
        0,
        "no HTML injected"
    );
    // And the reply comes back the other way, to both Consumers tabs.
    let input = workers_page.find(Locator::Id("body")).await.unwrap();
    input.send_keys("got it\n").await.unwrap();
    for page in [consumers_page, second_consumers_page] {
        wait_until(
            Duration::from_secs(20),
            "reply shown on the Consumers tabs",
            || async {
                let shown = messages(page).await;
                if shown == [text, "got it"] {
                    Ok(())
                } else {
                    Err(format!("{shown:?}"))
                }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_typed_on_a_consumers_tab_appears_on_the_workers_tab_and_the_other_consumers_tab()
{
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let second_consumers = stack
        .service_process_standby(Side::Consumers, "consumers-2", &[])
        .await;
    let workers = stack.service(Side::Workers, &[]).await;
    let (_driver, webdriver) = chromedriver().await;
    let consumers_page = browser(&webdriver).await;
    let second_consumers_page = browser(&webdriver).await;
    let workers_page = browser(&webdriver).await;
    // Run the scenario, then always end both browser sessions (they are chromedriver's
    // children), then report.
    let outcome = tokio::spawn({
        let (c, c2, w) = (
            consumers_page.clone(),
            second_consumers_page.clone(),
            workers_page.clone(),
        );
        let (ca, c2a, wa) = (
            format!("http://{}", consumers.addr),
            format!("http://{}", second_consumers.addr),
            format!("http://{}", workers.addr),
        );
        async move { scenario(&c, &c2, &w, [&ca, &c2a, &wa]).await }
    })
    .await;
    let _ = consumers_page.close().await;
    let _ = second_consumers_page.close().await;
    let _ = workers_page.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic.into_panic());
    }
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

/// Switching chats while the first chat's history is still on its way: nothing of the first
/// chat is drawn into the second, and the second's stream resumes at its own position.
async fn switch_scenario(page: &Client, consumers: &str, workers: std::net::SocketAddr) {
    page.goto(&format!("{consumers}/#chat=51")).await.unwrap();
    // Chat 51's history answers 1.5 s late (the failpoint); switch to 52 at once.
    let chat = page.find(Locator::Id("chat")).await.unwrap();
    chat.clear().await.unwrap();
    chat.send_keys("52\n").await.unwrap();
    wait_until(Duration::from_secs(20), "chat 52 live", || async {
        let status = page
            .find(Locator::Id("status"))
            .await
            .map_err(|e| e.to_string())?;
        match status.text().await.map_err(|e| e.to_string())?.as_str() {
            "live" => Ok(()),
            other => Err(other.to_string()),
        }
    })
    .await;
    // The scenario's pace: chat 51's late history lands after the switch.
    tokio::time::sleep(Duration::from_secs(2)).await;
    crate::support::send(workers, 52, "fast-new").await;
    wait_until(
        Duration::from_secs(20),
        "chat 52's messages only",
        || async {
            let shown = messages(page).await;
            if shown == ["fast-a", "fast-new"] {
                Ok(())
            } else {
                Err(format!("{shown:?}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_chats_while_history_loads_shows_only_the_new_chat_and_all_of_it() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack
        .service(Side::Consumers, &["--slow-history", "51:1500ms"])
        .await;
    let workers = stack.service(Side::Workers, &[]).await;
    for body in ["slow-a", "slow-b"] {
        crate::support::send(consumers.addr, 51, body).await;
    }
    crate::support::send(consumers.addr, 52, "fast-a").await;
    let (_driver, webdriver) = chromedriver().await;
    let page = browser(&webdriver).await;
    let outcome = tokio::spawn({
        let (page, url, workers) = (
            page.clone(),
            format!("http://{}", consumers.addr),
            workers.addr,
        );
        async move { switch_scenario(&page, &url, workers).await }
    })
    .await;
    let _ = page.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic.into_panic());
    }
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

/// A message whose send is being retried (503s) when the user switches chats.
async fn retried_send_scenario(page: &Client, consumers: &str, stack: &Stack<'_>) {
    page.goto(&format!("{consumers}/#chat=61")).await.unwrap();
    wait_until(Duration::from_secs(20), "chat 61 live", || async {
        let status = page
            .find(Locator::Id("status"))
            .await
            .map_err(|e| e.to_string())?;
        match status.text().await.map_err(|e| e.to_string())?.as_str() {
            "live" => Ok(()),
            other => Err(other.to_string()),
        }
    })
    .await;
    // Typed in chat 61, whose first two sends answer 503 (the failpoint): the page retries
    // after 1 s and 2 s; the user switches to chat 62 at once.
    let body = page.find(Locator::Id("body")).await.unwrap();
    body.send_keys("written-in-61\n").await.unwrap();
    let chat = page.find(Locator::Id("chat")).await.unwrap();
    chat.clear().await.unwrap();
    chat.send_keys("62\n").await.unwrap();
    let in_chat = |chat: i64| {
        format!("SELECT count(*) FROM consumers.messages WHERE chat_id = {chat} AND body = 'written-in-61'")
    };
    wait_until(
        Duration::from_secs(20),
        "the message written in chat 61",
        || async {
            match (
                stack.count(&in_chat(61)).await,
                stack.count(&in_chat(62)).await,
            ) {
                (1, 0) => Ok(()),
                other => Err(format!("(in 61, in 62): {other:?}")),
            }
        },
    )
    .await;
    // ... and nothing of it in chat 62's page or compose box.
    assert!(
        messages(page).await.is_empty(),
        "{:?}",
        messages(page).await
    );
    let compose = page.find(Locator::Id("body")).await.unwrap();
    assert_eq!(compose.prop("value").await.unwrap().as_deref(), Some(""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_retried_after_the_user_switched_chats_lands_in_the_chat_it_was_written_in() {
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack
        .service(Side::Consumers, &["--refuse-sends", "61:2"])
        .await;
    let (_driver, webdriver) = chromedriver().await;
    let page = browser(&webdriver).await;
    // The page is closed whatever the scenario's outcome (a panic comes back after).
    let url = format!("http://{}", consumers.addr);
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
        retried_send_scenario(&page, &url, &stack),
    ))
    .await;
    let _ = page.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    consumers.stop().await;
    stack.stop().await;
}

/// The page's status text, once it is `want`.
async fn wait_status(page: &Client, want: &str) {
    wait_until(
        Duration::from_secs(20),
        &format!("status {want}"),
        || async {
            let status = page
                .find(Locator::Id("status"))
                .await
                .map_err(|e| e.to_string())?;
            let text = status.text().await.map_err(|e| e.to_string())?;
            if text == want {
                Ok(())
            } else {
                Err(text)
            }
        },
    )
    .await;
}

/// The meta line (sender · side · time) of the page's messages.
async fn metas(page: &Client) -> Vec<String> {
    let mut texts = Vec::new();
    if let Ok(items) = page
        .find_all(Locator::Css("#messages .message .meta"))
        .await
    {
        for item in items {
            texts.push(item.text().await.unwrap_or_default());
        }
    }
    texts
}

async fn two_users_scenario(
    alice_page: &Client,
    bob_page: &Client,
    urls: [String; 2],
    tokens: [String; 2],
) {
    let [consumers, workers] = urls;
    let [alice, bob] = tokens;
    // Alice follows a sign-in link: it fills the form, and nothing happens until she
    // accepts (a link alone never signs anyone in).
    alice_page
        .goto(&format!("{consumers}/#chat=12&token={alice}"))
        .await
        .unwrap();
    wait_status(alice_page, "signed out").await;
    assert!(
        !alice_page
            .current_url()
            .await
            .unwrap()
            .as_str()
            .contains("token="),
        "the token left the address bar"
    );
    let error = alice_page
        .find(Locator::Id("error"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(error.contains("signs you in as alice"), "{error}");
    alice_page
        .find(Locator::Css("#signin button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_status(alice_page, "live").await;
    // Bob pastes his token into the sign-in form.
    bob_page.goto(&format!("{workers}/#chat=12")).await.unwrap();
    wait_status(bob_page, "signed out").await;
    bob_page
        .find(Locator::Id("token"))
        .await
        .unwrap()
        .send_keys(&bob)
        .await
        .unwrap();
    bob_page
        .find(Locator::Css("#signin button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_status(bob_page, "live").await;
    let who = bob_page
        .find(Locator::Id("who"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(who, "signed in as bob");

    let input = alice_page.find(Locator::Id("body")).await.unwrap();
    input.send_keys("hi bob\n").await.unwrap();
    wait_until(
        Duration::from_secs(20),
        "alice's message on bob's page",
        || async {
            let shown = metas(bob_page).await;
            match shown.first() {
                Some(meta) if meta.starts_with("alice · consumers") => Ok(()),
                _ => Err(format!("{shown:?}")),
            }
        },
    )
    .await;
    // The sender's name is isolated (<bdi>): a right-to-left name cannot reorder the line.
    let sender = bob_page
        .find(Locator::Css("#messages .message .meta bdi.sender"))
        .await
        .expect("the sender in a <bdi>");
    assert_eq!(sender.text().await.unwrap(), "alice");
    let input = bob_page.find(Locator::Id("body")).await.unwrap();
    input.send_keys("hi alice\n").await.unwrap();
    wait_until(
        Duration::from_secs(20),
        "bob's answer on alice's page",
        || async {
            let shown = metas(alice_page).await;
            match shown.get(1) {
                Some(meta) if meta.starts_with("bob · workers") => Ok(()),
                _ => Err(format!("{shown:?}")),
            }
        },
    )
    .await;
    // The cookie is HttpOnly: the page's script cannot read the token.
    let cookies = alice_page
        .execute("return document.cookie", vec![])
        .await
        .unwrap();
    assert_eq!(cookies, serde_json::json!(""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_users_sign_in_on_the_two_sides_and_see_each_other_by_name() {
    let stack = Stack::start(shared_postgres()).await;
    let idp = crate::support::Idp::new();
    let flags = idp.flags();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let consumers = stack.service(Side::Consumers, &flags).await;
    let workers = stack.service(Side::Workers, &flags).await;
    crate::support::add_member(consumers.addr, &idp, 12, "alice").await;
    crate::support::add_member(workers.addr, &idp, 12, "bob").await;
    let (_driver, webdriver) = chromedriver().await;
    let alice_page = browser(&webdriver).await;
    let bob_page = browser(&webdriver).await;
    let outcome = tokio::spawn({
        let (a, b) = (alice_page.clone(), bob_page.clone());
        let urls = [
            format!("http://{}", consumers.addr),
            format!("http://{}", workers.addr),
        ];
        let tokens = [idp.token("alice"), idp.token("bob")];
        async move { two_users_scenario(&a, &b, urls, tokens).await }
    })
    .await;
    let _ = alice_page.close().await;
    let _ = bob_page.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic.into_panic());
    }
    consumers.stop().await;
    workers.stop().await;
    stack.stop().await;
}

/// A Workers tab on instance A (behind a load balancer); A freezes; the time until a message
/// sent then is on the tab.
async fn frozen_instance_scenario(
    page: &Client,
    balancer: &testkit::balancer::Balancer,
    consumers: std::net::SocketAddr,
    a: &crate::support::ServiceProcess,
    b: std::net::SocketAddr,
) -> Duration {
    // Only A in rotation until the tab's stream is open (on A); then B too.
    balancer.set_enabled(1, false);
    page.goto(&format!("http://{}/#chat=61", balancer.addr()))
        .await
        .unwrap();
    wait_status(page, "live").await;
    balancer.set_enabled(1, true);
    crate::support::send(consumers, 61, "before").await;
    wait_until(Duration::from_secs(20), "shown before", || async {
        match messages(page).await.as_slice() {
            [one] if one == "before" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // A freezes: the balancer's health check takes it out; the tab's stream on it goes
    // silent, and nothing else tells the browser.
    a.child.signal(testkit::Signal::Stop).unwrap();
    let frozen = std::time::Instant::now();
    // Written on B by a Workers user: in the feed at once (no inbox failover in the way).
    crate::support::send(b, 61, "after").await;
    wait_until(
        Duration::from_secs(30),
        "shown after the freeze",
        || async {
            match messages(page).await.as_slice() {
                [_, two] if two == "after" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let took = frozen.elapsed();
    a.child.signal(testkit::Signal::Cont).unwrap();
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tab_on_a_frozen_instance_opens_its_stream_on_another_within_seconds() {
    // GIVEN two Workers instances behind a load balancer that checks /healthz, and a tab
    // through it whose stream is on the instance that then freezes (SIGSTOP: its kernel
    // still holds the connection open, so nothing tells the browser it is dead)
    let stack = Stack::start(shared_postgres()).await;
    let consumers = stack.service(Side::Consumers, &[]).await;
    let a = stack.service_process(Side::Workers, "workers-a", &[]).await;
    let b = stack
        .service_process_standby(Side::Workers, "workers-b", &[])
        .await;
    let balancer = testkit::balancer::Balancer::start(vec![(a.addr, a.addr), (b.addr, b.addr)])
        .await
        .unwrap();
    let (_driver, webdriver) = chromedriver().await;
    let page = browser(&webdriver).await;
    let outcome = tokio::spawn({
        let (page, consumers_addr, b_addr) = (page.clone(), consumers.addr, b.addr);
        async move {
            let took = frozen_instance_scenario(&page, &balancer, consumers_addr, &a, b_addr).await;
            (took, a, balancer)
        }
    })
    .await;
    let _ = page.close().await;
    let (took, _a, _balancer) = match outcome {
        Ok(done) => done,
        Err(panic) => std::panic::resume_unwind(panic.into_panic()),
    };
    // THEN the page noticed the silent stream (one and a half heartbeats) and showed the
    // message sent after the freeze through the other instance within seconds (a balancer
    // working per connection may first hand the new stream to a connection the browser kept
    // alive to the frozen one: given up after 2 s)
    println!("a tab on a frozen instance: the message sent after the freeze shown {took:?} later");
    assert!(took < Duration::from_secs(8), "{took:?}");
    consumers.stop().await;
    stack.stop().await;
}
