from services.worker.server import main

main()
