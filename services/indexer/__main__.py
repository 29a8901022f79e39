from services.indexer.server import main

main()
